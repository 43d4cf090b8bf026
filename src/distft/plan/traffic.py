"""Bytes each layout moves per optimizer step, over which link, and the compute they hide behind.

Per rank, per optimizer step of `Layout.microbatches` micro-batches (logical sizes, `distft.measure.comm`
convention; `hardware.wire_bytes` turns them into bytes on the wire):
- DDP: one all-reduce of the trainable gradients per step (bucketed, overlapping backward).
- ZeRO-1 (`zero1`: DDP + torch's ZeroRedundancyOptimizer): DDP's all-reduce of the trainable
  gradients, then one broadcast per rank of its partition of the updated trainable weights (every
  rank takes part in all N: the weights' bytes once, not overlapped).
- FSDP2: per micro-batch an all-gather of every parameter (twice for ZeRO-3: forward and again in
  backward; once for ZeRO-2) and a reduce-scatter of the trainable gradients. Frozen weights
  travel too: LoRA under FSDP moves the whole base model every micro-batch.
- HSDP: FSDP2's traffic inside each shard group (a node), and once per step an all-reduce of each
  rank's gradient shard (1/shard of the padded gradients) across the replicas (the nodes).
  Inside a pipeline (`fsdp+pp`, `fsdp+tp+pp`) once per step instead: torch's stage keeps the
  stage gathered and defers the reduce-scatter to its last backward (`fsdp_pipeline_gathers`).
- TP+SP (`tp-sp`): per layer and micro-batch 2 all-gathers and 2 reduce-scatters of a
  (batch, seq, hidden) activation forward and as many backward (one fewer when nothing before
  the first block trains); without SP the same bytes as all-reduces. Checkpointing repeats the
  forward ones. Plus one all-reduce of the replicated weights' partial gradients per step.
- TP (`tp`, and the TP inside `fsdp+tp`: PyTorch's parallelize_module): all-reduces of (batch, seq, hidden): 2 per layer
  forward, 5 backward (one per column projection; 3 fewer in layer 0 with frozen embeddings)
  and, with LoRA, small (batch, seq, r) ones per adapter, as `parallel/tensor_parallel.py` counts.
- PP: a (batch, seq, hidden) send forward and one backward per micro-batch and stage boundary;
  full finetuning of a tied embedding adds an all-reduce of its gradient (its FSDP shard).
Every weight counts by its shape (`ModelSpec.tensors`), the family's own included: Qwen2's q/k/v
biases travel with DDP's and FSDP's bytes (FSDP2 pads each on its own) and, split with their
weight's rows under TP, have complete gradients; Qwen3's q/k norms are TP's partial gradients.

Groups are laid out TP innermost, then data parallel (HSDP: its shard groups inside, its replicas
across), then pipeline; a group longer than a node crosses the inter-node link. Each collective
says whether it can overlap compute (`Collective.overlapped`): TP's sit on the critical path,
DDP's, FSDP's and a pipeline's sends overlap it. What that costs a step, with the compute they
hide behind, is `distft.plan.timing`'s.

The collective counts come from the runtime's own functions in `distft.measure.counts`
(`tp_activation_calls`, `megatron_crossings`, `fsdp_gathers_per_microbatch`), the ones the parity
tests check against the bytes counted on real gloo ranks. What differs is the input: the runtime
sums the tensors a rank holds, the planner their shapes from a `ModelSpec` (no model is built), and
tests/plan/test_traffic.py checks the two agree on the micro model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distft.measure.counts import (
    fsdp_gathers_per_microbatch,
    fsdp_pipeline_gathers,
    megatron_crossings,
    tp_activation_calls,
    tp_adapter_calls,
)
from distft.model.nf4 import nf4_gathered_bytes
from distft.parallel import STRATEGIES
from distft.parallel.context.model import layers_without_kv_gradient, padded_length
from distft.plan.hardware import Link, comm_time, wire_bytes
from distft.plan.inputs import (
    Parallelism,
    Training,
    holds_first_stage,
    holds_last_stage,
    pipeline_layout,
    rank_layers,
    rank_stages,
)
from distft.plan.memory import (
    layer_seq_len,
    local_shape,
    param_element_bytes,
    stage_tensors,
    trained_element_bytes,
)
from distft.plan.model_spec import ModelSpec


@dataclass
class Collective:
    what: str  # gradients, parameters, activations, ...
    kind: str  # all_reduce, all_gather, reduce_scatter, send
    logical_bytes: float  # per step, all calls together
    calls: int
    group: int  # ranks taking part
    link: Link
    overlapped: bool  # can hide behind compute

    @property
    def wire_bytes(self) -> float:
        return wire_bytes(self.kind, self.logical_bytes, self.group)

    @property
    def seconds(self) -> float:
        return comm_time(self.kind, self.logical_bytes, self.group, self.link, self.calls)


@dataclass(frozen=True)
class Topology:
    gpus_per_node: int
    nodes: int
    intra: Link
    inter: Link

    def link(self, size: int, stride: int) -> Link:
        """The slowest link a group of `size` ranks `stride` apart crosses."""
        return self.inter if self.nodes > 1 and size * stride > self.gpus_per_node else self.intra


def held_bytes(spec: ModelSpec, training: Training, par: Parallelism, what: str, rank: int = 0) -> float:
    """Logical bytes of pipeline rank `rank`'s TP/PP slice of the model, FSDP2's dim-0 padding included:
    `gradients` (trainable, in the gradient dtype), `trained` (trainable weights as stored: ZeRO-1's
    broadcast) or `gathered` (every weight as FSDP2 all-gathers it: in its param dtype, bf16 copies
    of fp32 master weights (`parallel.fsdp.mixed_precision`); an NF4 weight's inner tensors)."""
    total, n = 0.0, par.shard_degree
    for t, trains in stage_tensors(spec, training, par, rank):
        if what != "gathered" and not trains:
            continue
        shape = local_shape(t, par.tp, 0)
        numel = math.prod(shape)
        if what == "gathered" and training.method == "qlora" and t.kind == "linear":
            total += nf4_gathered_bytes(numel, training.quant, training.precision.param, n)
            continue
        if par.shard == "full" and n > 1 and shape[0]:
            numel = math.ceil(shape[0] / n) * n * (numel // shape[0])
        if what == "gradients":
            element = trained_element_bytes(t, training)[0]
        elif what == "gathered" and training.fp32_masters and training.method == "full":
            element = training.precision.param
        else:
            element = param_element_bytes(t, training)
        total += numel * element
    return total


# ---------------------------------------------------------------------------------------------
# Per-collective formulas (bytes and calls per optimizer step, one rank)
# ---------------------------------------------------------------------------------------------


def fsdp_gather_calls(layers: int, microbatches: int, reshard_after_forward: bool) -> int:
    """FSDP2 all-gathers per step: every unit (layers + root) in forward, again in backward for ZeRO-3."""
    return (layers + 1) * fsdp_gathers_per_microbatch(reshard_after_forward) * microbatches


def pipeline_boundary_bytes(spec: ModelSpec, training: Training, tp: int = 1, sp: bool = False) -> float:
    """One (batch, seq, hidden) activation crossing a stage boundary (per direction, micro-batch)."""
    c = training.precision.activation
    return c * training.micro_batch * training.seq_len * spec.hidden_size / (tp if sp else 1)


def dp_collectives(
    spec: ModelSpec, training: Training, par: Parallelism, link: Link, layers: int, rank: int = 0
) -> list[Collective]:
    """DDP's gradient all-reduce, ZeRO-1's all-reduce + broadcasts, FSDP2's per-unit traffic (over
    one shard group under HSDP: `link` is its link; `replica_collectives` adds the rest)."""
    grads = held_bytes(spec, training, par, "gradients", rank)
    if par.shard == "none":
        return [Collective("gradients", "all_reduce", grads, 1, par.dp, link, True)]
    if par.shard == "optimizer":
        weights = held_bytes(spec, training, par, "trained", rank)
        return [
            Collective("gradients", "all_reduce", grads, 1, par.dp, link, True),
            Collective("updated weights", "broadcast", weights, par.dp, par.dp, link, False),
        ]
    m, n = par.microbatches, par.shard_degree
    if par.pp > 1:  # fsdp+pp, fsdp+tp+pp: torch's stage gathers once and reduces once per step
        gathers = fsdp_pipeline_gathers(par.virtual_stages)
        params = held_bytes(spec, training, par, "gathered", rank) * gathers
        return [
            Collective("parameters", "all_gather", params, (layers + 1) * gathers, par.dp, link, True),
            Collective("gradients", "reduce_scatter", grads, layers + 1, par.dp, link, True),
        ]
    gathers = fsdp_gathers_per_microbatch(par.reshard_after_forward)
    params = held_bytes(spec, training, par, "gathered", rank) * gathers * m
    calls = fsdp_gather_calls(layers, m, par.reshard_after_forward)
    return [
        Collective("parameters", "all_gather", params, calls, n, link, True),
        Collective("gradients", "reduce_scatter", grads * m, (layers + 1) * m, n, link, True),
    ]


def replica_collectives(
    spec: ModelSpec, training: Training, par: Parallelism, link: Link, layers: int, rank: int = 0
) -> list[Collective]:
    """HSDP across its replicas: once per step, per unit, an all-reduce of this rank's
    reduce-scattered gradient shard (the padded gradients / shard)."""
    shard = held_bytes(spec, training, par, "gradients", rank) / par.shard_degree
    return [Collective("gradient shards", "all_reduce", shard, layers + 1, par.replicas, link, True)]


def tp_collectives(
    spec: ModelSpec, training: Training, par: Parallelism, link: Link, layers: int, rank: int = 0
) -> list[Collective]:
    """Tensor parallelism's activation collectives and the replicated weights' partial gradients."""
    m, c, lora = par.microbatches, training.precision.activation, training.lora
    T = training.micro_batch * layer_seq_len(training, par)
    act = c * T * spec.hidden_size
    ckpt = training.activation_checkpointing
    out = []
    if par.tensor_parallel == "megatron":
        # A block's entry carries a norm output (the weights' dtype) forward and its gradient
        # back; an exit a projection output (the compute dtype) and its gradient: with SP an
        # entry all-gathers forward and reduce-scatters backward, an exit the other way round.
        targets = set(training.lora_targets) if lora else set()
        enters, leaves, enters_bwd, leaves_bwd = megatron_crossings(layers, lora, targets, ckpt)
        enter = T * spec.hidden_size * training.precision.param
        leave = T * spec.hidden_size * (2 if training.autocast else c)  # bf16 projections under autocast
        if par.sp:
            gathered, gathers = m * (enter * enters + leave * leaves_bwd), m * (enters + leaves_bwd)
            scattered, scatters = m * (leave * leaves + enter * enters_bwd), m * (leaves + enters_bwd)
            out.append(Collective("activations", "all_gather", gathered, gathers, par.tp, link, False))
            out.append(Collective("activations", "reduce_scatter", scattered, scatters, par.tp, link, False))
        else:
            logical = m * (leave * leaves + enter * enters_bwd)
            out.append(
                Collective(
                    "activations", "all_reduce", logical, m * (leaves + enters_bwd), par.tp, link, False
                )
            )
    else:
        # Per stage this rank holds: a later stage's input needs its gradient (it is sent back).
        calls = sum(
            tp_activation_calls(n, lora, ckpt, not first)
            for n, first in rank_stages(spec, training, par, rank)
        )
        targets = set(training.lora_targets) if lora else set()
        adapters = tp_adapter_calls(layers, targets, ckpt)
        logical = m * (act * calls + c * T * training.lora_rank * adapters)
        out.append(
            Collective("activations", "all_reduce", logical, m * (calls + adapters), par.tp, link, False)
        )
    partial = partial_grad_bytes(spec, training, par, rank)
    if partial:
        out.append(Collective("partial gradients", "all_reduce", partial, 1, par.tp, link, False))
    return out


def cp_collectives(spec: ModelSpec, training: Training, par: Parallelism, link: Link) -> list[Collective]:
    """Context parallelism: per micro-batch and layer, K and V of the whole (padded) sequence
    all-gathered (again when checkpointing recomputes the layer's attention), dK and dV
    reduce-scattered back where the keys need a gradient; once per step, the gradients summed."""
    m, c, layers = par.microbatches, training.precision.activation, spec.num_layers
    kv = (
        2
        * c
        * training.micro_batch
        * padded_length(training.seq_len, par.cp)
        * spec.num_kv_heads
        * spec.head_dim
    )
    gathers = layers * (2 if training.activation_checkpointing in ("full", "offload") else 1)
    backward = layers - layers_without_kv_gradient(training.lora, set(training.lora_targets))
    grads = held_bytes(spec, training, par, "gradients")
    return [
        Collective("keys, values", "all_gather", m * kv * gathers, m * gathers, par.cp, link, False),
        Collective(
            "key, value gradients", "reduce_scatter", m * kv * backward, m * backward, par.cp, link, False
        ),
        Collective("gradients", "all_reduce", grads, 1, par.cp, link, False),
    ]


def pp_collectives(
    spec: ModelSpec, training: Training, par: Parallelism, link: Link, rank: int = 0
) -> list[Collective]:
    """Stage-boundary sends and receives (forward and backward per micro-batch) and, on the ranks
    holding a copy, the tied embedding's gradient."""
    boundary = pipeline_boundary_bytes(spec, training, par.tp, par.sp)
    messages = par.microbatches * pipeline_layout(spec, training, par).boundaries_of(rank)  # each way
    out = [
        Collective("stage activations", kind, boundary * messages, messages, 2, link, True)
        for kind in ("send", "recv")
    ]
    ends = holds_first_stage(par, rank) or holds_last_stage(par, rank)
    if spec.tie_word_embeddings and training.method == "full" and ends:
        # Both copies are whole on every TP rank (TP replicates the embedding); FSDP shards them.
        rows = math.ceil(spec.vocab_size / par.dp) if par.shard == "full" else spec.vocab_size
        tied = rows * spec.hidden_size * training.precision.grad
        out.append(Collective("tied embedding gradient", "all_reduce", tied, 1, 2, link, False))
    return out


def step_collectives(
    spec: ModelSpec, training: Training, par: Parallelism, topo: Topology, rank: int = 0
) -> list[Collective]:
    """Every collective of one optimizer step on the ranks of pipeline rank `rank` (every rank
    without a pipeline: their bytes are equal). Groups: TP innermost, then DP, then PP."""
    layers = len(rank_layers(spec, training, par, rank))
    out: list[Collective] = []
    if par.dp > 1:  # HSDP: shard groups of neighbouring ranks, replicas `shard` groups apart
        out += dp_collectives(spec, training, par, topo.link(par.shard_degree, par.tp), layers, rank)
    if par.replicas > 1:
        link = topo.link(par.replicas, par.tp * par.shard_degree)
        out += replica_collectives(spec, training, par, link, layers, rank)
    if par.tp > 1:
        out += tp_collectives(spec, training, par, topo.link(par.tp, 1), layers, rank)
    if par.pp > 1:
        out += pp_collectives(spec, training, par, topo.link(par.pp, par.tp * par.dp), rank)
    if par.cp > 1:
        out += cp_collectives(spec, training, par, topo.link(par.cp, 1))
    sequence_split = par.tp > 1 and par.tensor_parallel == "megatron" and par.sp
    scalars = STRATEGIES[par.name].step_scalars(par.dp, sequence_split) if par.world > 1 else ()
    if scalars:
        link = topo.link(par.world, 1)
        out.append(
            Collective(
                "loss, gradient norm", "all_reduce", sum(scalars), len(scalars), par.world, link, False
            )
        )
    return out


def partial_grad_bytes(spec: ModelSpec, training: Training, par: Parallelism, rank: int = 0) -> float:
    """Replicated trainable weights whose gradients each TP rank has only in part (summed once per step)."""
    g = training.precision.grad
    layers = rank_layers(spec, training, par, rank)
    if par.tensor_parallel == "dtensor":
        # parallelize_module: only q_norm / k_norm's (full finetuning; DTensor completes LoRA's own
        # gradients), sharded over dp under FSDP (`parallel/tensor_parallel.py`).
        dp = par.dp if par.shard == "full" else 1
        return (
            0.0 if training.lora or not spec.qk_norm else 2 * math.ceil(spec.head_dim / dp) * len(layers) * g
        )
    if training.lora:
        held = set(layers)
        lora = spec.lora_tensors(training.lora_rank, training.lora_targets, training.dora)
        return sum(t.numel for t in lora if t.tp_dim is None and t.layer in held) * g
    qk = 2 * spec.head_dim * len(layers) if spec.qk_norm else 0
    if par.tensor_parallel == "megatron" and par.sp:  # every replicated weight sees a sequence shard
        norms = 2 * spec.hidden_size * len(layers) + spec.hidden_size
        embed = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
        return (qk + norms + embed) * g
    return qk * g
