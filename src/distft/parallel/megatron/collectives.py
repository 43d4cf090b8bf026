"""Autograd-aware collectives for Megatron-style tensor (TP) and sequence (SP) parallelism.

A collective inside a model must carry gradients: each one below runs through one
`torch.autograd.Function` (`_Conjugate`) whose backward is the collective's adjoint (its transpose
as a linear map), so two of them form a conjugate pair. Activations run sequence-first, (seq, batch, hidden), so "along the sequence" is
dimension 0 and every gathered or scattered buffer is contiguous without a transpose.

| function                      | forward                      | backward                         |
|-------------------------------|------------------------------|----------------------------------|
| `copy_to_tp_region`    (f)    | identity                     | all-reduce                       |
| `reduce_from_tp_region` (g)   | all-reduce                   | identity                         |
| `gather_from_sp_region` (g')  | all-gather along the sequence| reduce-scatter along the sequence|
| `reduce_scatter_to_sp_region` | reduce-scatter along sequence| all-gather along the sequence    |

Plain TP brackets each block with f ... g (Shoeybi et al., 1909.08053, fig. 3); TP + SP replaces
them with all-gather ... reduce-scatter (Korthikanti et al., 2205.05198, fig. 5): the same bytes on
the wire (an all-reduce *is* a reduce-scatter followed by an all-gather), but what lies between two
blocks is sharded along the sequence instead of replicated.

Nothing here is sharded by itself: these move activations (and, for export, weight shards) between
the ranks of a TP group. Every collective runs on a detached, contiguous tensor. A collective on a tensor that requires
grad can leave the gloo group unusable (PITFALLS.md), and c10d expects dense buffers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

# torch 2.13 deprecates `all_gather_into_tensor` / `reduce_scatter_tensor` (a FutureWarning per
# process) in favour of these; older torch has only the old names. Same c10d ops either way.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---- plain collectives on dimension 0 (no autograd) -------------------------------------------


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum of `x` over the group, in a new tensor (the input may be saved by autograd elsewhere)."""
    out = x.detach().clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def all_gather(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenation along dim 0 of every rank's `x`, in rank order: (n, ...) -> (world * n, ...)."""
    x = x.detach().contiguous()
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    _all_gather(out, x, group=group)
    return out


def reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's chunk along dim 0 of the sum over ranks: (world * n, ...) -> (n, ...)."""
    world = dist.get_world_size(group)
    if x.shape[0] % world:
        raise ValueError(f"reduce-scatter: dim 0 ({x.shape[0]}) is not divisible by {world} ranks")
    x = x.detach().contiguous()
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    _reduce_scatter(out, x, group=group)
    return out


def all_gather_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`all_gather` along any dimension (used to reassemble weight shards for export)."""
    return all_gather(x.movedim(dim, 0), group).movedim(0, dim).contiguous()


# ---- the conjugate pairs -----------------------------------------------------------------------


def _same(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The identity, as a view (an autograd Function's output must not be its input)."""
    return x.view_as(x)


class _Conjugate(torch.autograd.Function):
    """Forward: `forward_fn(x, group)`. Backward: `backward_fn(grad, group)`, its adjoint."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup | None, forward_fn, backward_fn):
        ctx.group, ctx.backward_fn = group, backward_fn
        return forward_fn(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.backward_fn(grad, ctx.group), None, None, None


def copy_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Forward: identity. Backward: all-reduce, summing each rank's partial input gradient."""
    return _Conjugate.apply(x, group, _same, all_reduce)


def reduce_from_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Forward: all-reduce the partial sums. Backward: identity (every rank already has the full grad)."""
    return _Conjugate.apply(x, group, all_reduce, _same)


def gather_from_sp_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """(seq / N, batch, hidden) on each rank -> (seq, batch, hidden) on every rank. Backward:
    reduce-scatter of the full-sequence gradients."""
    return _Conjugate.apply(x, group, all_gather, reduce_scatter)


def reduce_scatter_to_sp_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """(seq, batch, hidden) partial sums on each rank -> this rank's (seq / N, batch, hidden) of the
    sum. Backward: all-gather of the shard gradients."""
    return _Conjugate.apply(x, group, reduce_scatter, all_gather)


def all_reduce_shares(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The sum over the ranks of `x` (each rank's part of a whole: a sequence shard's log-probability
    sums), where each rank then computes its share of one loss (`MegatronLM`'s preference head).
    Backward: all-reduce too, each rank backpropagating its share: the shares' gradients sum to
    the loss's."""
    return _Conjugate.apply(x, group, all_reduce, all_reduce)


def sequence_sums(
    logps: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup | None, grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's log-probability and labelled tokens, summed over the ranks that each hold a
    shard of it (tp-sp, cp): one all-reduce of both; training (`grad`), `all_reduce_shares`."""
    both = torch.stack([logps, counts])
    both = all_reduce_shares(both, group) if grad and torch.is_grad_enabled() else all_reduce(both, group)
    return both[0], both[1]
