"""What a mixture of experts changes in a step's collectives: expert parallelism's all-to-alls
(`fsdp+ep`, as `plan/experts.py` describes them; beside them FSDP's all-gathers and
reduce-scatters of everything but the expert stacks, `traffic.dp_collectives`), and tensor
parallelism's all-reduces of an MoE layer's MLP (`tp`), which are not a dense MLP's, tp-sp's
collectives of each position's expert choices (`megatron_expert_terms`), and the routers' sums
that a pipeline sends beside its hidden states (`pp`) and context parallelism (`cp`) and tp-sp
all-reduce.
"""

from __future__ import annotations

import math
from dataclasses import replace

from distft.model.experts import STACKS
from distft.parallel.pipeline.cost import MLP_PROJECTIONS
from distft.plan.collective import Collective, Topology, held_bytes
from distft.plan.counts import (
    RECOMPUTED_ROW_PROJECTIONS,
    frozen_embedding,
    fsdp_gathers_per_microbatch,
    megatron_crossings,
)
from distft.plan.hardware import Link
from distft.plan.inputs import Parallelism, Training, compute_bytes, rank_layers
from distft.plan.memory import layer_seq_len, trained_element_bytes
from distft.plan.model_spec import ModelSpec
from distft.plan.preference_traffic import kl_shapes

COUNT_BYTES = 8  # an int64 per expert: the all-to-all of the counts
SUM_BYTES = 4  # an fp32 per router sum


def ep_collectives(
    spec: ModelSpec, training: Training, par: Parallelism, topo: Topology, rank: int, group_dim: str
) -> list[Collective]:
    """Expert parallelism's collectives of one optimizer step on pipeline rank `rank`, each named by
    its mesh dimension: the all-to-alls inside its expert group (`group_dim` where the group is every
    data-parallel rank, else "ep"), and across the groups the experts' gradients ("replicate")."""
    layers = rank_layers(spec, training, par, rank)
    routed = routing_collectives(spec, training, par, topo.link(par.ep, par.tp), len(layers))
    link = topo.link(par.dp // par.ep, par.ep * par.tp)  # across the groups
    across = expert_replica_collectives(spec, training, par, link, rank)
    group = "ep" if par.ep < par.dp else group_dim
    return [replace(c, dim=group) for c in routed] + [replace(c, dim="replicate") for c in across]


def routing_collectives(
    spec: ModelSpec, training: Training, par: Parallelism, link: Link, layers: int
) -> list[Collective]:
    """The all-to-alls of one optimizer step, one rank, inside its expert group: the counts in each
    forward, the routed rows there and back in each forward and backward."""
    forwards = 2 if training.checkpointed else 1  # a checkpointed layer dispatches again
    passes = forwards + 1
    shapes = training.shapes(par.microbatches)
    rows = sum(batch * seq for batch, seq in shapes) * spec.num_experts_per_tok
    calls = len(shapes) * layers
    routed = rows * spec.hidden_size * compute_bytes(training, par) * layers * 2 * passes
    counts = calls * forwards * spec.num_experts * COUNT_BYTES
    return [
        Collective("routed tokens", "all_to_all", routed, calls * 2 * passes, par.ep, link, False),
        Collective("expert counts", "all_to_all", counts, calls * forwards, par.ep, link, False),
    ]


def expert_replica_collectives(
    spec: ModelSpec, training: Training, par: Parallelism, link: Link, rank: int
) -> list[Collective]:
    """Expert groups smaller than the data-parallel ranks (`parallel.ep`), across the dp / ep groups
    that hold the same experts (this rank's E / ep of each stack):
    - replicated: once per step, the gradients summed, one all-reduce a stack; none where the
      stacks are frozen (LoRA);
    - sharded (`parallel.shard_experts`, FSDP2 over the groups, each layer's stacks one unit): per
      micro-batch their all-gather (again in backward for ZeRO-3) and their gradients'
      reduce-scatter, as FSDP2 moves the rest (`collective.held_bytes`)."""
    replicas, trains, m = par.dp // par.ep, training.method == "full", par.microbatches
    if replicas < 2 or not (trains or par.shard_experts):
        return []
    held = set(rank_layers(spec, training, par, rank))
    stacks = [t for t in spec.tensors() if t.kind == "experts" and t.layer in held]
    if not par.shard_experts:
        nbytes = sum(t.numel // par.ep * trained_element_bytes(t, training)[0] for t in stacks)
        return [Collective("expert gradients", "all_reduce", nbytes, len(stacks), replicas, link, False)]
    units = len({t.layer for t in stacks})
    gathers = fsdp_gathers_per_microbatch(par.reshard_after_forward) * m
    gathered = held_bytes(spec, training, par, "gathered", rank, experts=True) * gathers
    out = [Collective("experts", "all_gather", gathered, units * gathers, replicas, link, True)]
    if trains:
        reduced = held_bytes(spec, training, par, "gradients", rank, experts=True) * m
        out.append(Collective("expert gradients", "reduce_scatter", reduced, units * m, replicas, link, True))
    return out


def tp_expert_terms(
    spec: ModelSpec, training: Training, par: Parallelism, layers: int, targets: set[str]
) -> tuple[float, int]:
    """(bytes, calls) per step that tensor parallelism of an MoE (`parallel/tp_experts.py`) adds to
    the dense count of `tp_traffic.tp_collectives`. Per MoE layer and micro-batch, the dense MLP's
    all-reduces do not run (down_proj's forward and its recompute, gate's and up's backward, and
    their adapters'); the experts' do: their weighted output forward (T h; a recomputed layer does
    not repeat it, its hook sits past the checkpoint) and, backward, the gradients of their hidden
    input (T h) and of the routing weights (T k)."""
    recomputed = "down_proj" in RECOMPUTED_ROW_PROJECTIONS[training.activation_checkpointing]
    dense = 1 + 2 + recomputed  # (T, h) all-reduces of a dense MLP
    adapters = sum(n in targets for n in MLP_PROJECTIONS) + (recomputed and "down_proj" in targets)
    h, k, r = spec.hidden_size, spec.num_experts_per_tok, training.lora_rank
    shapes = training.shapes(par.microbatches)
    positions = sum(rows * seq for rows, seq in shapes)
    logical = compute_bytes(training, par) * positions * layers * (h * (2 - dense) + k - r * adapters)
    return logical, len(shapes) * layers * (3 - dense - adapters)


def tp_expert_partial_grads(spec: ModelSpec, training: Training, layers: list[int], dp: int = 1) -> float:
    """The experts' whole adapter factors under TP (gate_up's lora_A, down's lora_B): each rank's
    gradient is its intermediate slice's share, all-reduced once per step; under `fsdp+tp` (`dp`
    FSDP ranks) FSDP2's dim-0 shard of it."""
    held = set(layers)
    lora = spec.lora_tensors(training.lora_rank, training.lora_targets)
    whole = [t for t in lora if t.module in STACKS and t.tp_dim is None]
    shard = [math.ceil(t.shape[0] / dp) * t.numel // t.shape[0] for t in whole if t.layer in held]
    return sum(shard) * training.precision.grad


def megatron_expert_terms(
    spec: ModelSpec, training: Training, par: Parallelism, layers: int, targets: set[str]
) -> tuple[float, int, float, int]:
    """(forward bytes, calls, backward bytes, calls) per step that an MoE adds to tp-sp's crossings
    (`parallel/megatron/model.py`, `MegatronLM.experts`): each rank routes its own positions, and
    each MoE layer's choices enter the block beside the hidden state, which crosses as a dense
    MLP's input does. With SP, forward: all-gathers of the routing weights (k per position, the
    router's dtype) and the chosen experts (k int64), again where the layer is recomputed;
    backward: a reduce-scatter of the weights' gradient where it has one. Without SP only that
    backward, as an all-reduce (f's). Forwards without backward (a reference, KTO's KL term)
    gather both once per model run. All 0 on a dense model."""
    if not spec.moe:
        return 0.0, 0, 0.0, 0
    shapes, kl = training.shapes(par.microbatches), kl_shapes(training, par)
    positions = sum(rows * layer_seq_len(training, par, seq) for rows, seq in shapes)
    k = spec.num_experts_per_tok
    weight = 2 if training.autocast else training.precision.param  # the router's logits' dtype
    crossings = megatron_crossings(
        layers, frozen_embedding(spec, training), targets, training.activation_checkpointing
    )
    # The weights need a gradient where the MLP block's input does; a recomputed layer routes again.
    backward, recomputed = crossings.mlp_enters_bwd, crossings.recomputed
    backward_bytes, backward_calls = positions * k * weight * backward, len(shapes) * backward
    if not par.sp:
        return 0.0, 0, backward_bytes, backward_calls
    only = training.reference_forward * positions  # model runs without backward
    only += training.kl_forwards * sum(rows * layer_seq_len(training, par, seq) for rows, seq in kl)
    only_runs = training.reference_forward * len(shapes) + training.kl_forwards * len(kl)
    gathered = (positions * (layers + recomputed) + only * layers) * k * (weight + COUNT_BYTES)
    gathers = 2 * (len(shapes) * (layers + recomputed) + only_runs * layers)
    return gathered, gathers, backward_bytes, backward_calls


def router_sums_bytes(spec: ModelSpec) -> int:
    """One micro-batch's routers' sums (each expert's probability and assignments, logsumexp^2 and
    the rows: 2E + 2 floats, `distft.model.router.RouterLosses.layer_sums`)."""
    return (2 * spec.num_experts + 2) * SUM_BYTES


def pp_router_sums(spec: ModelSpec, par: Parallelism, link: Link, boundaries: int) -> list[Collective]:
    """A pipeline's routers' sums, sent across each stage boundary beside the hidden states in
    every training micro-batch, their gradient back: the auxiliary losses pool the layers of all
    stages."""
    if not spec.moe:
        return []
    messages = par.microbatches * boundaries  # each way
    nbytes = messages * router_sums_bytes(spec)
    return [Collective("router sums", kind, nbytes, messages, 2, link, True) for kind in ("send", "recv")]


def cp_router_sums(
    spec: ModelSpec, par: Parallelism, link: Link, micro_batches: int, ranks: int | None = None
) -> list[Collective]:
    """Context parallelism's routers' sums: each rank's share of every row's tokens, all-reduced
    once per training micro-batch so that the auxiliary losses pool them all (over `ranks`: the
    CP degree, or tp-sp's with SP)."""
    if not spec.moe:
        return []
    nbytes = micro_batches * router_sums_bytes(spec)
    return [Collective("router sums", "all_reduce", nbytes, micro_batches, ranks or par.cp, link, False)]
