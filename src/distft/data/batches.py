"""Batches: the rows of optimizer step `s` are a fixed function of (seed, s, global batch size).

So every strategy and process count trains on exactly the same global batch. A data-parallel
rank takes its contiguous slice of it (`rank_micro_batches`), cut into micro-batches, and each
micro-batch becomes tensors in one of two layouts (docs/packing.md):

- padded (`collate`): one row per sequence, right-padded to the longest, with a 2-D attention mask;
- packed (`pack`): the sequences end to end in one row, no padding and no attention mask. Position
  ids restart at 0 at every document, so rotary embeddings see what they would see alone, and
  that restart is what the attention reads to keep every document to itself (transformers builds
  a block-diagonal causal mask from it, or runs flash-attention's varlen kernel on CUDA).
"""

from __future__ import annotations

import functools

import torch

from distft.data.chat import IGNORE, Example


def global_batch_indices(step: int, n_rows: int, global_batch_size: int, seed: int) -> list[int]:
    """Rows of optimizer step `step`: a stream of seeded per-epoch permutations, cut in batches."""
    start = step * global_batch_size
    indices: list[int] = []
    while len(indices) < global_batch_size:
        epoch, offset = divmod(start + len(indices), n_rows)
        perm = _epoch_order(n_rows, seed, epoch)
        indices.extend(perm[offset : offset + global_batch_size - len(indices)].tolist())
    return indices


@functools.lru_cache(maxsize=2)  # this epoch's and the next: one permutation per epoch, not per step
def _epoch_order(n_rows: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


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


def pack(
    examples: list[Example], pad_id: int, pad_to: int | None = None, multiple: int = 1
) -> dict[str, torch.Tensor]:
    """The examples end to end in one (1, total) row, with per-document position ids.

    Labels are already shifted within each example (its last position predicts nothing), so no
    position predicts the next document's first token. `pad_to` (fixed-shape strategies: the
    pipeline) or `multiple` (a length bucket, so compiled code sees few shapes) appends a fill that
    is a document of its own: positions from 0, no loss. A row of one document and no fill carries
    no position ids: plain causal attention, exactly what it needs, with nothing to detect.
    """
    input_ids = [t for e in examples for t in e.input_ids]
    labels = [t for e in examples for t in e.labels]
    position_ids = [p for e in examples for p in range(len(e.input_ids))]
    length = pad_to or -(-len(input_ids) // multiple) * multiple
    if multiple > 1 and not pad_to:  # at least two buckets: a dimension of size 1 is a graph of its own
        length = max(length, 2 * multiple)
    fill = length - len(input_ids)
    if fill < 0:
        raise ValueError(f"{len(input_ids)} tokens do not fit a packed row of {pad_to}")
    input_ids += [pad_id] * fill
    labels += [IGNORE] * fill
    position_ids += range(fill)
    row = {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}
    if len(examples) == 1 and not fill and pad_to is None:
        del row["position_ids"]
    return {k: torch.tensor([v], dtype=torch.long) for k, v in row.items()}


def label_positions(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices of the labelled positions of a host batch (`LossLM`'s `label_positions`),
    read on the host where the batch is built, so the device never has to report a count."""
    flat = labels.flatten().tolist()
    return torch.tensor([i for i, t in enumerate(flat) if t != IGNORE], dtype=torch.long)


def micro_batch(
    examples: list[Example], pad_id: int, packed: bool, pad_to: int | None = None, multiple: int = 1
) -> dict[str, torch.Tensor]:
    """One micro-batch's tensors: packed into one row (`pad_to` long, if given, else a multiple of
    `multiple`) or padded rows."""
    return pack(examples, pad_id, pad_to, multiple) if packed else collate(examples, pad_id, pad_to)


def count_label_tokens(examples: list[Example]) -> int:
    return sum(sum(1 for t in e.labels if t != IGNORE) for e in examples)


def rank_micro_batches(
    examples: list[Example], dp_rank: int, dp_size: int, micro_batch_size: int
) -> list[list[Example]]:
    """This data-parallel rank's contiguous slice of a global batch, cut into micro-batches."""
    per_rank = len(examples) // dp_size
    mine = examples[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
