"""An MoE layer's forward under expert parallelism (`fsdp+ep`, `fsdp_ep.py` explains the
mechanism): the tokens dispatched to their experts' ranks by all-to-all, the local experts' MLPs
over the rows they received, the rows combined back; every move of rows a gather both ways."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from peft.tuners.lora.layer import ParamWrapper
from torch import nn

from distft.model.experts import (
    STACKS,
    Combine,
    Dispatch,
    Factors,
    grouped_mlp,
    read_adapters,
    sort_by_expert,
    swiglu,
)

Stack = tuple[torch.Tensor, Factors | None]  # a local expert stack and its LoRA factors


def experts_base(experts: nn.Module) -> nn.Module:
    """transformers' experts module under peft's parameter wrappers (one per LoRA'd stack)."""
    while isinstance(experts, ParamWrapper):
        experts = experts.base_layer
    return experts


def local_adapters(experts: nn.Module, first: int, count: int) -> dict[str, Factors]:
    """The active LoRA adapter's factors of each adapted stack (peft's for the whole stack,
    `read_adapters`), sliced to this rank's `count` experts from `first`; applied to the rows or
    merged by `grouped_projection`'s rule."""
    read = read_adapters(experts)
    if read is None:  # distft trains one adapter, merged only by an export
        raise RuntimeError("fsdp+ep computes one unmerged LoRA adapter on the expert stacks")
    local = slice(first, first + count)
    return {name: (b[local], a[local], scaling) for name, (b, a, scaling) in read[1].items()}


def local_experts(
    base: nn.Module, rows: torch.Tensor, per_expert: list[int], factors: dict[str, Factors], grouped: bool
) -> torch.Tensor:
    """This rank's experts' MLPs over their rows (`expert_mlps`), the module's stacks read here: a
    method of the experts module, so that FSDP gathers them first where they are sharded. Stacks
    kept whole as fp32 master weights compute in the rows' dtype, as FSDP's gathered copies do."""
    stacks = {name: (getattr(base, name).to_local().to(rows.dtype), factors.get(name)) for name in STACKS}
    return expert_mlps(rows, per_expert, stacks, base.act_fn, grouped)


def expert_parallel_forward(
    experts: nn.Module,
    hidden: torch.Tensor,  # (tokens, hidden)
    top_k_index: torch.Tensor,  # (tokens, k): each token's experts
    top_k_weights: torch.Tensor,  # (tokens, k): their renormalised router probabilities
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Dispatch each token to its experts' ranks, run the local experts, combine: the
    experts module's output, (tokens, hidden), as transformers' own forward computes it."""
    base, world = experts_base(experts), dist.get_world_size(group)
    num_experts, k = base.num_experts, top_k_index.shape[1]
    local = num_experts // world
    first = dist.get_rank(group) * local

    # token t's k pairs sorted by expert, so by destination rank
    sorted_experts, order, inverse, token_of_row = sort_by_expert(top_k_index)
    counts = torch.bincount(sorted_experts, minlength=num_experts)
    received_counts = torch.empty_like(counts)  # [source rank, local expert]
    dist.all_to_all_single(received_counts, counts, group=group)
    send = counts.view(world, local).sum(dim=1).tolist()  # the sizes: the host sync
    received_counts_host = received_counts.view(world, local)
    receive = received_counts_host.sum(dim=1).tolist()

    # Every move of rows is a gather, forward and backward (`Dispatch`, `Permute`, `Combine`):
    # autograd's own backward of a gather is a scatter-add (atomics on CUDA).
    rows, row_weights = Dispatch.apply(hidden, top_k_weights, token_of_row, order, inverse)
    rows = exchange(rows, receive, send, group)
    # Rows arrive by source rank, each source's by expert: regroup them by local expert.
    expert_of_row = torch.arange(local, device=hidden.device).repeat(world)
    expert_of_row = expert_of_row.repeat_interleave(received_counts_host.reshape(-1))
    by_expert = torch.argsort(expert_of_row, stable=True)
    arrived = torch.argsort(by_expert)  # the inverse permutation: back in the order the rows came
    outputs = base.local_experts(
        Permute.apply(rows, by_expert, arrived),
        received_counts_host.sum(dim=0).tolist(),
        local_adapters(experts, first, local),
        base.config._experts_implementation in ("grouped_mm", "grouped_lora"),
    )
    returned = exchange(Permute.apply(outputs, arrived, by_expert), send, receive, group)
    # The routing weights stay on this rank: each returned row weighted here, a token's k summed.
    return Combine.apply(returned * row_weights[:, None], token_of_row, inverse, k).to(hidden.dtype)


def exchange(
    rows: torch.Tensor, receive: list[int], send: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """All-to-all of rows: `send[r]` consecutive rows to rank r, `receive[r]` from it; backward
    sends the gradients the other way."""
    out = funcol.all_to_all_single_autograd(rows, receive, send, group)
    return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


class Permute(torch.autograd.Function):
    """Rows reordered (`rows[index]`, `index` a permutation), backward by the inverse permutation's
    gather (`back`) rather than autograd's scatter-add."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, index: torch.Tensor, back: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(back)
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (back,) = ctx.saved_tensors
        return grad.index_select(0, back), None, None


def expert_mlps(
    rows: torch.Tensor,
    per_expert: list[int],
    stacks: dict[str, Stack],
    act_fn: nn.Module,
    grouped: bool = True,
) -> torch.Tensor:
    """Each local expert's SwiGLU MLP over its consecutive rows (`per_expert` of them): one grouped
    matmul per projection over the local stack, its adapter applied to the rows or merged
    (`distft.model.experts.grouped_mlp`), the activation fused (`swiglu`), where
    `model.experts_implementation` is grouped, else a loop over the local experts, as
    transformers' eager path computes one."""
    if grouped:
        offsets = torch.tensor(per_expert, device=rows.device).cumsum(0, dtype=torch.int32)
        return grouped_mlp(rows, offsets, stacks, lambda gate_up: swiglu(act_fn, gate_up))

    def linear(x: torch.Tensor, name: str, e: int) -> torch.Tensor:
        weight, factors = stacks[name]
        out = nn.functional.linear(x, weight[e])
        if factors is None:
            return out
        b, a, scaling = factors
        return out + scaling * nn.functional.linear(nn.functional.linear(x, a[e]), b[e])

    outputs = []
    for e, part in enumerate(rows.split(per_expert)):
        gate, up = linear(part, "gate_up_proj", e).chunk(2, dim=-1)
        outputs.append(linear(act_fn(gate) * up, "down_proj", e))
    return torch.cat(outputs)
