"""Tensor helpers every layer uses (a leaf: imports torch only).

Sharded strategies hand out `DTensor`s: a global view over per-rank shards. Counting bytes, filling
or scaling a gradient in place needs the shard this rank holds, which `local` returns for a DTensor
and a plain tensor alike.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes these tensors occupy on this rank (a DTensor counts its shard only)."""
    return sum(local(t).nbytes for t in tensors)


@contextlib.contextmanager
def quiet_redistribute() -> Iterator[None]:
    """`full_tensor()` of a weight sharded over two mesh dimensions (TP and FSDP) logs that it takes
    one all-gather per dimension. True, and at export only: quieted while it runs."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq) index of the document each position of a packed row belongs to: a new one
    wherever the position does not continue the previous one by 1 (transformers' rule)."""
    previous = torch.cat([position_ids[:, :1] - 1, position_ids[:, :-1]], dim=1)
    return (position_ids != previous + 1).cumsum(dim=1)
