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

Or the groups shard what they would replicate (`parallel.shard_experts`, torchtitan's
`dp_shard_mod_ep`): FSDP2 over the "replicate" dimension cuts each rank's stacks along the experts
again, 1/(N/EP) of them on each of the N/EP ranks holding the same experts (`shard_across_groups`).
Each layer's are gathered as the layer starts (prefetched, under attention's compute) and again in
backward, and their gradients reduce-scattered across the groups: 1/N of the experts' weights,
gradients and optimizer state per rank, for those gathers on the link between the groups every
micro-batch, where replicas all-reduce once per step.

What each rank holds. The expert stacks (`mlp.experts.gate_up_proj`, `down_proj`: nearly all of an
MoE's weights) as DTensors sharded along the expert dimension (and replicated across the groups),
E/EP experts whole, gathered at most across the groups; the FSDP2 of the rest leaves them alone
(`ignored_params`) and shards everything else (attention, router, norms, embeddings, LoRA's
adapters) over all N ranks, as under `fsdp`. Full finetuning keeps the optimizer state of the
local experts only.

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
bytes, over the N / EP replicas), or with the experts sharded across the groups, per micro-batch
two all-gathers of those bytes and a reduce-scatter of their gradients.

Gradient scale. Each rank scales its loss by N, which FSDP's averaging divides out (`Strategy.
averaged_over`). An expert's weight gradient is not averaged: its rank received every token of its
group for it, so the gradient is the group's share of the global batch, N times over; summed
across the replicas (the whole batch) and divided by N after the backward (or by FSDP2's
reduce-scatter across the groups, its divisor set to N). An expert's LoRA
factors are FSDP's like every adapter: each rank's gradient holds only its own experts' slices,
and FSDP's reduce-scatter over all N sums the slices (every group's) into the whole.

Paper: Lepikhin et al., "GShard" (2006.16668), section 2.2; Fedus et al., "Switch Transformers"
(2101.03961). torchtitan builds the same from the same pieces (its `ExpertParallel`).
"""

from __future__ import annotations

import functools
import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import DataParallelMeshDims, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers import PretrainedConfig

from distft.config import Config
from distft.errors import ConfigError
from distft.layout import ParallelDims
from distft.layout.rules import expert_split
from distft.model import causal_lm
from distft.model.experts import STACKS
from distft.parallel.dims import build_mesh
from distft.parallel.expert_dispatch import expert_parallel_forward, experts_base, local_experts
from distft.parallel.fsdp import FSDP, fsdp_settings, shard_units
from distft.tensors import quiet_redistribute


class FSDPExpertParallel(FSDP):
    name = "fsdp+ep"

    @classmethod
    def validate_config(cls, cfg: Config) -> None:
        super().validate_config(cfg)
        ep, world = ParallelDims.of(cls.spec, cfg).ep, cfg.world_size  # one that divides the processes
        if ep == 1 and world > 1:
            raise ConfigError(
                "--strategy fsdp+ep with parallel.ep=1 keeps every expert on every rank, which is --strategy "
                "fsdp without FSDP's shards of the experts: use --strategy fsdp, or parallel.ep of 2 or more."
            )
        if cfg.parallel.shard_experts and ep == world:
            raise ConfigError(
                f"parallel.shard_experts shards the experts across fsdp+ep's expert groups, and with "
                f"parallel.ep={ep} (every process) there is one group: set parallel.ep to a divisor of {world} "
                "below it (e.g. the GPUs of a node), or drop parallel.shard_experts."
            )

    @classmethod
    def validate_model(cls, cfg: Config, model_config: PretrainedConfig) -> None:
        super().validate_model(cfg, model_config)
        experts, ep = getattr(model_config, "num_experts", 0), ParallelDims.of(cls.spec, cfg).ep
        if not experts:
            raise ConfigError(
                f"--strategy fsdp+ep shards a mixture of experts' experts, and {cfg.model.name} has none: "
                "use --strategy fsdp."
            )
        if expert_split(ep, experts):
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
        # ("dp",) when every rank is one expert group; else ("replicate", "ep"), an expert group being EP
        # consecutive ranks (a node), as HSDP's shard groups are, and "dp" flattened over both.
        self.mesh, self.flattened = build_mesh(self.spec, self.dims, self.env.device.type)
        self.expert_mesh = self.mesh
        layers = list(causal_lm(model.lm).model.layers)
        stacks = [w for layer in layers for w in shard_experts(layer.mlp.experts, self.expert_mesh)]
        experts = [experts_base(layer.mlp.experts) for layer in layers]
        if self.cfg.parallel.shard_experts:  # FSDP2's from here, across the groups
            settings = fsdp_settings(model, self.expert_mesh, self.cfg, self.spec.reshard_after_forward)
            for module in experts:
                shard_across_groups(module, settings, self.averaged_over)
        # The stacks FSDP2 does not manage, their gradients completed by hand (`after_backward`).
        self.expert_weights = [] if self.cfg.parallel.shard_experts else stacks
        return shard_units(
            model,
            layers,
            self.flattened.get("dp", self.mesh),  # every rank
            self.cfg,
            self.spec.reshard_after_forward,
            ignored=set(self.expert_weights),
            inner=experts if self.cfg.parallel.shard_experts else None,  # gathered under attention
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

    def trainable_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        with quiet_redistribute():  # export only: gathering shards of two dimensions logs per dimension
            return super().trainable_state_dict(model)


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
    # the experts' weighted sum out, as the MoE block calls it. The stacks are read in a method of
    # their own module, which FSDP gathers them for where they are sharded across the groups.
    experts.forward = functools.partial(expert_parallel_forward, experts, group=mesh.get_group(group_dim))
    base.local_experts = types.MethodType(local_experts, base)
    return sharded


def shard_across_groups(base: nn.Module, settings: dict, divide_by: int) -> None:
    """FSDP2 over the expert mesh's "replicate" dimension (`parallel.shard_experts`): each expert
    group's stacks cut along the experts again, 1/R of the rank's on each of the R replicas, gathered
    for `local_experts` (forward, and again in backward), their gradients reduce-scattered across
    the replicas and divided by N (the loss's scale, `averaged_over`) rather than FSDP's R."""
    fully_shard(base, **settings, dp_mesh_dims=DataParallelMeshDims(shard="replicate"))
    base.set_gradient_divide_factor(divide_by)
    base.set_force_sum_reduction_for_comms(True)  # divided apart: gloo has no pre-multiplied sum
    register_fsdp_forward_method(base, "local_experts")
