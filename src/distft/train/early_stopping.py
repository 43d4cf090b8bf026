"""Early stopping: a run ends once its validation loss stops improving (`train.early_stopping_patience`).

After each validation (every `train.eval_every` steps) the loop hands the validation loss to
`EarlyStopping.update`. A loss below the best so far minus `train.early_stopping_delta` is an
improvement; once `patience` validations in a row bring none, the run ends after that step as a
finished run: it exports the weights of that last step (not those of the best validation), writes
`early_stop` into the step's `metrics.jsonl` record and prints `stop_line`.

Every rank must stop after the same step. The loss decided on is the same float on every rank:
`distft.train.step.evaluate` reduces it over the ranks (a pipeline's last stage holds it alone)
and broadcasts rank 0's value. The state (the best loss, its step, the validations since) goes into
every checkpoint's `trainer.json` (`state_dict`), so a resumed run stops where the uninterrupted
one would; a checkpoint written before it existed resumes with a fresh state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distft.text import plural


@dataclass
class EarlyStopping:
    patience: int = 0
    """Validations in a row without improvement that end the run (0: never; the best is still kept)."""
    delta: float = 0.0
    """The least fall below the best loss that counts as an improvement."""
    best: float = math.inf
    """The best validation loss so far (inf: none yet)."""
    best_step: int = 0
    """The step of `best` (0: none yet)."""
    stale: int = 0
    """Validations in a row since the last improvement."""

    def update(self, loss: float, step: int) -> bool:
        """Take the validation loss after step `step`; True: the run ends after this step."""
        if loss < self.best - self.delta:  # a NaN never improves
            self.best, self.best_step, self.stale = loss, step, 0
        else:
            self.stale += 1
        return 0 < self.patience <= self.stale

    def record(self, step: int, loss: float) -> dict:
        """The `early_stop` entry of the last step's `metrics.jsonl` record."""
        return {
            "step": step,
            "eval_loss": loss,
            "best_eval_loss": None if math.isinf(self.best) else self.best,
            "best_step": self.best_step,
            "validations_without_improvement": self.stale,
            "patience": self.patience,
            "delta": self.delta,
            "kept": "last",  # the exported weights are the last step's, not the best validation's
        }

    def state_dict(self) -> dict:
        """What a checkpoint keeps; JSON (a float's repr reads back bit for bit), inf as None."""
        return {
            "best": None if math.isinf(self.best) else self.best,
            "best_step": self.best_step,
            "stale": self.stale,
        }

    def load_state_dict(self, state: dict | None) -> None:
        """Restore `state_dict`'s; None (a checkpoint written before early stopping): a fresh state."""
        state = state or {}
        best = state.get("best")
        self.best = math.inf if best is None else float(best)
        self.best_step = int(state.get("best_step", 0))
        self.stale = int(state.get("stale", 0))


def stop_line(record: dict) -> str:
    """The line a run stopped early prints, from its `early_stop` record."""
    head = f"early stop at step {record['step']}: validation loss {record['eval_loss']:.4f}"
    stale = plural(record["validations_without_improvement"], "validation")
    patience = f"train.early_stopping_patience={record['patience']}"
    if record["best_eval_loss"] is None:  # not one finite loss (NaN, inf)
        return f"{head}; no finite validation loss in {stale} ({patience}); keeping the last step's weights"
    by = f" by more than {record['delta']:g}" if record["delta"] else ""
    return (
        f"{head} has not improved{by} on {record['best_eval_loss']:.4f} (step {record['best_step']}) for "
        f"{stale} ({patience}); keeping the last step's weights"
    )
