"""FSDP x expert parallelism (`fsdp+ep`): each rank holds 1/EP of the experts, whole, and every token
travels to its experts' ranks and back by all-to-all; the rest of the model is sharded by FSDP.

`distft train --model qwen3-moe-micro --strategy fsdp+ep --nproc 2`: N ranks, each reading its own
rows (data parallel over all N), each holding experts [r E/N, (r+1) E/N) of every MoE layer.

Expert groups (`parallel.ep`, EP; 0, the default: N). The ranks form a 2D mesh ("replicate", "ep"):
EP consecutive ranks (a node) split the experts between them, and the N / EP such groups each hold
every expert once, replicas of each other. A token travels only inside its rank's group, so the
all-to-alls stay on the node's links; the price is E / EP experts per rank instead of E / N, and
an all-reduce of the experts' gradients across the replicas once per step (full finetuning; under
LoRA the stacks are frozen). With 4 ranks and EP = 2, {0, 1} and {2, 3} each hold experts 0-3 on
their first rank and 4-7 on their second, and {0, 2}, {1, 3} are replicas.

What each rank holds. The expert stacks (`mlp.experts.gate_up_proj`, `down_proj`: nearly all of an
MoE's weights) as DTensors sharded along the expert dimension (and replicated across the groups),
E/EP experts whole, never gathered; FSDP2 leaves them alone (`ignored_params`) and shards
everything else (attention, router, norms, embeddings, LoRA's adapters) over all N ranks, as under
`fsdp`. Full finetuning keeps the optimizer state of the local experts only.

Each MoE layer's forward (`expert_parallel_forward`), per micro-batch of T tokens routed to k
experts each:
1. sort the T x k (token, expert) assignments by expert and count them per expert;
2. all-to-all of the counts (E integers): each rank learns how many rows it will receive from
   every rank for each of its experts;
3. all-to-all of the rows (dispatch, T k x hidden): each goes to the rank holding its expert;
4. each local expert's SwiGLU MLP over its rows (its LoRA factors applied to the rows, or merged
   where that is fewer multiply-adds: `grouped_projection`): one grouped matmul per projection and
   factor over the local stack (`model.experts_implementation`);
5. all-to-all back (combine, the same sizes reversed), then each token sums its k outputs
   weighted by the router's probabilities.
Backward runs the two row all-to-alls in reverse. Routing is dropless: every assignment is
computed (no capacity factor, no token dropped), at the price of uneven all-to-all sizes, known
only after step 2 (a host sync per layer).

Bytes per micro-batch and MoE layer: 2 T k hidden x dtype bytes forward (dispatch and combine),
the same again in backward (and again in a forward recomputed by activation checkpointing), plus
E x 8 bytes of counts per forward. Beside them, FSDP's all-gathers and reduce-scatters of the rest,
and with replicas, once per step, the all-reduce of the local experts' gradients (E/EP experts'
bytes, over the N / EP replicas).

Gradient scale. Each rank scales its loss by N, which FSDP's averaging divides out (`Strategy.
averaged_over`). An expert's weight gradient is not averaged: its rank received every token of its
group for it, so the gradient is the group's share of the global batch, N times over; summed
across the replicas (the whole batch) and divided by N after the backward. An expert's LoRA
factors are FSDP's like every adapter: each rank's gradient holds only its own experts' slices,
and FSDP's reduce-scatter over all N sums the slices (every group's) into the whole.

Paper: Lepikhin et al., "GShard" (2006.16668), section 2.2; Fedus et al., "Switch Transformers"
(2101.03961). torchtitan builds the same from the same pieces (its `ExpertParallel`).
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from peft.tuners.lora.layer import ParamWrapper
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers import PretrainedConfig

from distft.config import Config
from distft.errors import ConfigError
from distft.model import causal_lm
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
from distft.parallel.fsdp import FSDP, shard_units

Stack = tuple[torch.Tensor, Factors | None]  # a local expert stack and its LoRA factors


class FSDPExpertParallel(FSDP):
    name = "fsdp+ep"
    needs_moe: ClassVar[bool] = True
    supports_fp8: ClassVar[bool] = False
    supports_qlora: ClassVar[bool] = False
    qlora_refusal: ClassVar[str] = "its experts are fused parameter stacks that NF4 does not quantize"
    supports_compile: ClassVar[bool] = False  # the all-to-all sizes read on the host: a graph break per layer
    label = "FSDP x EP"
    holds = "1/EP of the experts, whole (EP = `parallel.ep`, every rank by default); 1/N of every other param, grad, optimizer state"
    moves = "all-to-all of each MoE layer's routed tokens (there and back) inside its EP group; FSDP's all-gather / reduce-scatter of the rest"
    page = "moe.md#expert-parallelism-fsdpep"
    collectives = "the all-to-alls of routed tokens and FSDP's all-gathers / reduce-scatters (fsdp+ep)"

    @classmethod
    def expert_degree(cls, cfg: Config) -> int:
        """Ranks splitting the experts between them (EP): `parallel.ep`, by default every rank."""
        return cfg.parallel.ep or cfg.world_size

    @classmethod
    def validate_config(cls, cfg: Config) -> None:
        super().validate_config(cfg)
        ep, world = cls.expert_degree(cfg), cfg.world_size
        if world % ep:
            raise ConfigError(
                f"parallel.ep={ep} must divide the {world} processes (--nproc x --nnodes) into equal expert "
                f"groups; e.g. parallel.ep={cfg.parallel.nproc}, one group per node."
            )
        if ep == 1 and world > 1:
            raise ConfigError(
                "--strategy fsdp+ep with parallel.ep=1 keeps every expert on every rank, which is --strategy "
                "fsdp without FSDP's shards of the experts: use --strategy fsdp, or parallel.ep of 2 or more."
            )

    @classmethod
    def validate_model(cls, cfg: Config, model_config: PretrainedConfig) -> None:
        super().validate_model(cfg, model_config)
        experts, ep = getattr(model_config, "num_experts", 0), cls.expert_degree(cfg)
        if not experts:
            raise ConfigError(
                f"--strategy fsdp+ep shards a mixture of experts' experts, and {cfg.model.name} has none: "
                "use --strategy fsdp."
            )
        if experts % ep:
            whole = ep == cfg.world_size
            ranks, count = (
                ("processes", "a process count") if whole else ("ranks of an expert group", "a parallel.ep")
            )
            raise ConfigError(
                f"--strategy fsdp+ep gives each of the {ep} {ranks} an equal share of {cfg.model.name}'s "
                f"{experts} experts: use {count} that divides {experts}."
            )

    def parallelize(self, model: nn.Module) -> nn.Module:
        model.to(self.env.device)
        device, world, ep = self.env.device.type, self.env.world_size, self.expert_degree(self.cfg)
        self.mesh = init_device_mesh(device, (world,), mesh_dim_names=("dp",))
        # Row-major: an expert group is EP consecutive ranks (a node), as HSDP's shard groups are.
        self.expert_mesh = (
            self.mesh
            if ep == world
            else init_device_mesh(device, (world // ep, ep), mesh_dim_names=("replicate", "ep"))
        )
        layers = list(causal_lm(model.lm).model.layers)
        self.expert_weights: list[nn.Parameter] = []
        for layer in layers:
            self.expert_weights += shard_experts(layer.mlp.experts, self.expert_mesh)
        units = layers if self.cfg.parallel.fsdp_wrap == "layer" else []
        return shard_units(
            model, units, self.mesh, self.cfg, self.reshard_after_forward, ignored=set(self.expert_weights)
        )

    def after_backward(self, model: nn.Module) -> None:
        # Every token of the group reached this rank's experts, each scaled by N (`averaged_over`);
        # the replicas' groups read the rest of the batch. One all-reduce per stack, in place and
        # all in flight at once: a flat copy would hold every local expert's gradient a second time.
        grads = [weight.grad.to_local() for weight in self.expert_weights if weight.grad is not None]
        if self.expert_mesh.ndim > 1:
            group = self.expert_mesh.get_group("replicate")
            for pending in [dist.all_reduce(grad, group=group, async_op=True) for grad in grads]:
                pending.wait()
        for grad in grads:
            grad.div_(self.averaged_over)

    def mesh_groups(self) -> dict[str, list[int]]:
        groups = super().mesh_groups()
        if self.expert_mesh is not self.mesh:
            names = self.expert_mesh.mesh_dim_names or ()
            groups |= {n: dist.get_process_group_ranks(self.expert_mesh.get_group(n)) for n in names}
        return groups


def experts_base(experts: nn.Module) -> nn.Module:
    """transformers' experts module under peft's parameter wrappers (one per LoRA'd stack)."""
    while isinstance(experts, ParamWrapper):
        experts = experts.base_layer
    return experts


def shard_experts(experts: nn.Module, mesh: DeviceMesh) -> list[nn.Parameter]:
    """Keep this rank's experts of each stack (a DTensor sharded along the experts over the mesh's
    last dimension, the expert group, and replicated over any before it) and route the module's
    forward through the all-to-all (`expert_parallel_forward`); the new parameters."""
    group_dim = mesh.ndim - 1
    base, rank, ep = experts_base(experts), mesh.get_local_rank(group_dim), mesh.size(group_dim)
    local = base.num_experts // ep
    placements = [Replicate()] * group_dim + [Shard(0)]
    sharded = []
    for name in STACKS:
        full = getattr(base, name)
        shard = full.detach()[rank * local : (rank + 1) * local].clone()
        weight = nn.Parameter(
            DTensor.from_local(shard, mesh, placements, run_check=False), full.requires_grad
        )
        setattr(base, name, weight)
        sharded.append(weight)
    # The module's own forward, replaced on this instance: (hidden, top_k_index, top_k_weights) in,
    # the experts' weighted sum out, as the MoE block calls it.
    experts.forward = functools.partial(expert_parallel_forward, experts, group=mesh.get_group(group_dim))
    return sharded


def local_expert_weights(experts: nn.Module, first: int, count: int) -> dict[str, Stack]:
    """This rank's experts' stacks, (count, out, in) each, with their active LoRA adapter's factors
    (peft's for the whole stack, `read_adapters`, sliced to the local experts; applied to the rows
    or merged by `grouped_projection`'s rule)."""
    read = read_adapters(experts)
    if read is None:  # distft trains one adapter, merged only by an export
        raise RuntimeError("fsdp+ep computes one unmerged LoRA adapter on the expert stacks")
    base, factors = read
    local = slice(first, first + count)
    sliced = {name: (b[local], a[local], scaling) for name, (b, a, scaling) in factors.items()}
    return {name: (getattr(base, name).to_local(), sliced.get(name)) for name in STACKS}


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
    outputs = expert_mlps(
        Permute.apply(rows, by_expert, arrived),
        received_counts_host.sum(dim=0).tolist(),
        local_expert_weights(experts, first, local),
        base.act_fn,
        grouped=base.config._experts_implementation in ("grouped_mm", "grouped_lora"),
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
