"""What `train` returns: the run's figures, and how it ended where a signal stopped it (after
which step, before which phase, the checkpoint it left) in the one line the main rank prints."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from distft import signals
from distft.io.checkpoint import resume_hint
from distft.train.metrics import step_time_line


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)  # measured, seconds per step
    predicted_step_times: list[float | None] = field(default_factory=list)  # the planner's (None: no peak)
    eval_losses: dict[int, float] = field(default_factory=dict)
    output_dir: Path | None = None
    model: torch.nn.Module | None = None  # this rank's trained `LossLM` (unwrapped)
    early_stop: dict | None = None  # why validation ended the run (`distft.train.early_stopping`)
    stopped_by: int | None = None  # the signal that stopped the run early (`distft.signals`)
    stopped_after: int = 0  # ... after this step
    stopped_in: str = ""  # ... before its "validation" or the "export" ("": at a step boundary)
    checkpoint: Path | None = None  # ... having written this checkpoint (None: none written)
    first_step: int = 1  # the first step this command ran (a resumed run's is past 1)

    def add(self, record: dict) -> None:
        """One step's figures (its `metrics.jsonl` record): its loss, measured and predicted time."""
        self.losses.append(record["loss"])
        self.step_times.append(record["step_time_s"])
        self.predicted_step_times.append(record["step_time_predicted_s"])

    def time_line(self, prediction: dict | None) -> str:
        return step_time_line(prediction, self.step_times, self.predicted_step_times, self.first_step)

    def stopped_line(self, max_steps: int) -> str:
        """The one line a run stopped by a signal ends with: where, what was saved, how to go on."""
        head = f"distft train: stopped by {signals.name(self.stopped_by)} after step {self.stopped_after} of {max_steps}"
        if self.stopped_in:  # the step's update is done; what is left of it runs on resume
            final = "final " if self.stopped_after == max_steps and self.stopped_in == "validation" else ""
            head += f", before {'the' if self.stopped_in == 'export' else 'its'} {final}{self.stopped_in}"
        if self.checkpoint is None:
            hint = resume_hint(self.output_dir)
            return f"{head}; no checkpoint written (train.checkpoint_on_signal=false). {hint}"
        return f"{head}; checkpoint written to {self.checkpoint}. Resume with: distft train --resume {self.output_dir}"
