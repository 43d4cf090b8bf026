"""DPO's and KTO's reference log-probabilities computed once, before the first step
(`dpo.precompute_reference`).

DPO and KTO compare the policy with a reference, the model as training starts. Under LoRA the base with
the adapters disabled is that model, run in every step's forward (`distft.model.lm.LossLM`); under
full finetuning the base itself trains, so nothing in the running model is the reference any more.
Here each pair the run reads (KTO: each answer and its mismatched answer), its steps' and the
validation batches it evaluates, is scored once with the model as it starts (every pair where the
run can be extended: `output.checkpoint_every`), a bar on the logging rank: every rank runs its data-parallel slice of each global batch through the strategy's own forward (the loss
head returns each row's log-probability, `LossLM.scoring`), a vector of every pair's two values is
summed over the ranks as a loss is (`Strategy.reduce_loss`), and every rank ends with all of them.
They are written to the run directory (`reference_logps.safetensors`, atomically, by rank 0) and a
resumed run reads them back rather than scoring the trained model.

Cost: one forward over those pairs, no gradients and no optimizer, before
the first step; then no reference forward in the steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from safetensors.torch import load_file, save_file

from distft.config.choices import ITEM_NAMES, WITH_REFERENCE
from distft.data.batches import global_batch_indices
from distft.data.pairs import PairSplit
from distft.errors import TrainingError
from distft.io.files import atomic_path
from distft.parallel.base import unwrap
from distft.train.progress import TrainingProgress
from distft.train.setup import Run
from distft.train.step import between_batches, eval_batch_count, rank_batches

REFERENCE_FILE = "reference_logps.safetensors"


def attach_reference(run: Run, progress: TrainingProgress) -> None:
    """Give the run's pair splits their reference log-probabilities: read from the run directory,
    or scored now, a bar on the logging rank, and written there (`dpo.precompute_reference` only)."""
    cfg = run.cfg
    if cfg.train.objective not in WITH_REFERENCE or not cfg.dpo.precompute_reference:
        return
    path = run.out / REFERENCE_FILE
    splits = {"train": run.train_set, "validation": run.val_set}
    read, item = pairs_read(run), ITEM_NAMES[cfg.train.objective]
    if path.is_file():
        scores = load_file(path)
    elif run.start_step > 0:  # scoring now would score the trained model, not the one that started
        raise TrainingError(
            f"{path} is missing: the run resumes after step {run.start_step}, and the reference is "
            "the model as the run started, scored before its first step. Restore the file, or start over."
        )
    else:
        every = {name: range(len(split)) for name, split in splits.items()}
        if cfg.output.checkpoint_every and sum(map(len, read.values())) < sum(map(len, every.values())):
            read = every
            progress.note(
                f"scoring the reference of every {item}, not only those of the {cfg.train.max_steps} steps: "
                "with output.checkpoint_every the run can be extended (--resume DIR --max-steps N), which reads more"
            )
        scoring = run.collective("scoring the reference log-probabilities before the first step")
        with scoring, progress.counting("reference", sum(map(len, read.values())), f"{item}s") as advance:
            scores = {name: score(run, split, read[name], advance) for name, split in splits.items()}
        if run.env.is_main:
            with atomic_path(path) as tmp:
                save_file(scores, tmp)
    for name, split in splits.items():
        if scores[name][list(read[name])].isnan().any():
            raise TrainingError(
                f"{path} holds the reference of the {item}s the run read when it started, and this run reads "
                f"{name} {item}s it did not score: a larger train.max_steps or train.eval_batches than it "
                "started with. Keep those, or start over (with output.checkpoint_every every one is scored)."
            )
        split.reference = [tuple(row) for row in scores[name].tolist()]


def pairs_read(run: Run) -> dict[str, Sequence[int]]:
    """The pairs of each split the run reads (KTO: answers): its steps' (`global_batch_indices`),
    and the validation batches an evaluation reads (none without train.eval_batches)."""
    t, n = run.cfg.train, len(run.train_set)
    train: Sequence[int] = range(n)
    if t.max_steps * t.global_batch_size < n:  # fewer than an epoch: only some are read
        steps = (global_batch_indices(s, n, t.global_batch_size, t.seed) for s in range(t.max_steps))
        train = sorted({i for step in steps for i in step})
    validation = min(len(run.val_set), eval_batch_count(run) * t.global_batch_size) if t.eval_batches else 0
    return {"train": train, "validation": range(validation)}


@torch.no_grad()
def score(run: Run, split: PairSplit, read: Sequence[int], advance: Callable[[int], None]) -> torch.Tensor:
    """(pairs, 2): each pair's chosen and rejected log-probability under the model as it is (KTO:
    each answer's and its mismatched answer's); NaN for the pairs not in `read`."""
    strategy, lm = run.strategy, unwrap(run.model)
    gb, dp_size, dp_rank = run.cfg.train.global_batch_size, strategy.dp_size, strategy.dp_rank
    scores = torch.zeros(len(split), 2, device=run.env.device)
    lm.scoring = True
    run.model.eval()
    try:
        for start in range(0, len(read), gb):
            between_batches(run, "reference", start // gb)
            chunk = torch.tensor(read[start : start + gb], device=scores.device)
            offset = dp_rank * (gb // dp_size)  # this rank's slice (`rank_micro_batches`); blanks fill it
            pairs = [split.pairs[i] for i in chunk.tolist()]
            for batch in rank_batches(pairs, strategy, run.cfg, run.pad_id, part="score"):
                with run.autocast:
                    logps = strategy.scores(run.model, [batch])
                chosen, rejected = logps.chunk(2)
                rows = torch.arange(offset, offset + len(chosen), device=logps.device)
                keep = rows < len(chunk)  # not the blank items
                scores[chunk[rows[keep]]] = torch.stack([chosen, rejected], dim=1)[keep]
                offset += len(chosen)
            advance(len(chunk))
    finally:
        lm.scoring = False
        strategy.release_gathered(run.model)
        run.model.train()
    scores = strategy.reduce_loss(scores).cpu()
    unread = torch.ones(len(split), dtype=torch.bool)
    unread[list(read)] = False
    return scores.masked_fill(unread[:, None], float("nan"))
