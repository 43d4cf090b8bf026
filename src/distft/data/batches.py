"""Batches: the rows of optimizer step `s` are a fixed function of (seed, s, global batch size).

So every strategy and process count trains on exactly the same global batch. A data-parallel
rank takes its contiguous slice of it (`rank_micro_batches`), cut into micro-batches.
"""

from __future__ import annotations

import torch

from distft.data.chat import IGNORE, Example


def global_batch_indices(step: int, n_rows: int, global_batch_size: int, seed: int) -> list[int]:
    """Rows of optimizer step `step`: a stream of seeded per-epoch permutations, cut in batches."""
    start = step * global_batch_size
    indices: list[int] = []
    while len(indices) < global_batch_size:
        epoch, offset = divmod(start + len(indices), n_rows)
        perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        indices.extend(perm[offset : offset + global_batch_size - len(indices)].tolist())
    return indices


def collate(examples: list[Example], pad_id: int, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example (or `pad_to`); padding has attention 0 and no loss."""
    length = pad_to or max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        attention_mask[i, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def count_label_tokens(examples: list[Example]) -> int:
    return sum(sum(1 for t in e.labels if t != IGNORE) for e in examples)


def rank_micro_batches(
    examples: list[Example], dp_rank: int, dp_size: int, micro_batch_size: int
) -> list[list[Example]]:
    """This data-parallel rank's contiguous slice of a global batch, cut into micro-batches."""
    per_rank = len(examples) // dp_size
    mine = examples[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
