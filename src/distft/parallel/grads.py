"""Gradient helpers shared by the strategies: one norm-and-clip, one flat all-reduce.

Every strategy logs the same gradient norm a single process would compute on the same global
batch, so their runs compare. What differs is only where each gradient element lives:
- *shared*: a gradient this rank holds a slice of (an FSDP or TP shard, a pipeline stage's own
  weights), or one that several ranks of the group hold identical copies of (counted 1/copies
  times on each). Its squared norm is summed over the ranks of `group`.
- *replicated*: a gradient every rank of the group holds whole and equal (DDP after its
  all-reduce, TP's replicated norms after theirs). Counted once, locally.
Squares are summed in float64: fp32 sums over a 150k x hidden embedding gradient drift by ~1e-5.
Norms and the clip run as foreach kernels: a handful of launches per step, not ~6 per tensor
(504 LoRA tensors in Qwen3-4B).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from distft.tensors import local


def clip_grad_norm_(
    shared: Iterable[tuple[torch.Tensor, int]],
    replicated: Iterable[torch.Tensor],
    max_norm: float,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The global gradient norm (returned before clipping, a float64 tensor on `device`: reading it is
    the caller's host sync); scales every gradient by
    min(1, max_norm / norm) when `max_norm` > 0, as `torch.nn.utils.clip_grad_norm_` does.

    `shared` holds (gradient, copies) pairs summed over `group`; `replicated` gradients are counted
    on this rank alone.
    """
    shared, replicated = list(shared), list(replicated)
    shared_grads = [local(g) for g, _ in shared]
    shared_sum = _sum_of_squares(shared_grads, [c for _, c in shared], device)
    if shared:
        dist.all_reduce(shared_sum, group=group)
    norm = (_sum_of_squares(replicated, None, device) + shared_sum).sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in shared_grads + replicated:
            by_dtype.setdefault(g.dtype, []).append(g)
        for dtype, grads in by_dtype.items():
            torch._foreach_mul_(grads, coef.to(dtype))
    return norm


def _sum_of_squares(
    grads: list[torch.Tensor], copies: list[int] | None, device: torch.device
) -> torch.Tensor:
    """Sum over `grads` of |g|² (each divided by its `copies`), in float64: one fused norm kernel
    for all of them (`_foreach_norm`) instead of a few launches per tensor."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    squares = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)) ** 2
    if copies is not None and any(c != 1 for c in copies):
        squares = squares / torch.tensor(copies, dtype=torch.float64).to(device, non_blocking=True)
    return squares.sum()


def all_reduce_flat(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Sum `tensors` over `group` in place with one collective (one launch instead of one each)."""
    if not tensors:
        return
    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    for t, summed in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
        t.copy_(summed)
