"""DPO's and KTO's reference log-probabilities computed once, before the first step
(`dpo.precompute_reference`).

DPO and KTO compare the policy with a reference, the model as training starts. Under LoRA the base with
the adapters disabled is that model, run in every step's forward (`distft.model.lm.LossLM`); under
full finetuning the base itself trains, so nothing in the running model is the reference any more.
Here each training and validation pair (KTO: each answer and its mismatched answer) is scored once
with the model as it starts: every rank
runs its data-parallel slice of each global batch through the strategy's own forward (the loss
head returns each row's log-probability, `LossLM.scoring`), a vector of every pair's two values is
summed over the ranks as a loss is (`Strategy.reduce_loss`), and every rank ends with all of them.
They are written to the run directory (`reference_logps.safetensors`, atomically, by rank 0) and a
resumed run reads them back rather than scoring the trained model.

Cost: one forward over the training and validation pairs, no gradients and no optimizer, before
the first step; then no reference forward in the steps.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from distft.config.choices import WITH_REFERENCE
from distft.data.pairs import PairSplit
from distft.errors import TrainingError
from distft.io.files import atomic_path
from distft.parallel.base import unwrap
from distft.train.setup import Run
from distft.train.step import between_batches, rank_batches

REFERENCE_FILE = "reference_logps.safetensors"


def attach_reference(run: Run) -> None:
    """Give the run's pair splits their reference log-probabilities: read from the run directory,
    or scored now and written there (DPO with `dpo.precompute_reference` only)."""
    cfg = run.cfg
    if cfg.train.objective not in WITH_REFERENCE or not cfg.dpo.precompute_reference:
        return
    path = run.out / REFERENCE_FILE
    splits = {"train": run.train_set, "validation": run.val_set}
    if path.is_file():
        scores = load_file(path)
    elif run.start_step > 0:  # scoring now would score the trained model, not the one that started
        raise TrainingError(
            f"{path} is missing: the run resumes after step {run.start_step}, and the reference is "
            "the model as the run started, scored before its first step. Restore the file, or start over."
        )
    else:
        with run.collective("scoring the reference log-probabilities before the first step"):
            scores = {name: score(run, split) for name, split in splits.items()}
        if run.env.is_main:
            with atomic_path(path) as tmp:
                save_file(scores, tmp)
    for name, split in splits.items():
        split.reference = [tuple(row) for row in scores[name].tolist()]


@torch.no_grad()
def score(run: Run, split: PairSplit) -> torch.Tensor:
    """(pairs, 2): each pair's chosen and rejected log-probability under the model as it is (KTO:
    each answer's and its mismatched answer's)."""
    strategy, lm = run.strategy, unwrap(run.model)
    gb, dp_size, dp_rank = run.cfg.train.global_batch_size, strategy.dp_size, strategy.dp_rank
    scores = torch.zeros(len(split), 2, device=run.env.device)
    lm.scoring = True
    run.model.eval()
    try:
        for start in range(0, len(split), gb):
            between_batches(run, "reference", start // gb)
            count = min(gb, len(split) - start)
            padded = -(-count // dp_size) * dp_size  # every rank an equal slice: pad with the first pair
            pairs = [split.pairs[start + (i if i < count else 0)] for i in range(padded)]
            offset = start + dp_rank * (padded // dp_size)  # this rank's slice (`rank_micro_batches`)
            for batch in rank_batches(pairs, strategy, run.cfg, run.pad_id, part="score"):
                with run.autocast:
                    logps = strategy.scores(run.model, [batch])
                chosen, rejected = logps.chunk(2)
                rows = torch.arange(offset, offset + len(chosen), device=logps.device)
                keep = rows < start + count  # not the padding
                scores[rows[keep]] = torch.stack([chosen, rejected], dim=1)[keep]
                offset += len(chosen)
    finally:
        lm.scoring = False
        strategy.release_gathered(run.model)
        run.model.train()
    return strategy.reduce_loss(scores).cpu()
