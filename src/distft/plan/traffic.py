"""The bytes-moved formula: what each layout's collectives carry per optimizer step, over which link.

One formula per strategy, used three ways: `distft plan` on shapes, a run's prediction
(`plan.auto.predict`) on its config, and every run's first step (`plan.expected`) on its own
micro-batches, recorded beside the bytes the run counted; the parity tests hold the two equal to
the byte on real gloo ranks. Per rank, per optimizer step (logical sizes, `distft.measure.comm`'s
convention; `hardware.wire_bytes` turns them into bytes on the wire):
- DDP: one all-reduce of the trainable gradients per step (bucketed, overlapping backward); its
  misconfiguration switches add theirs (`ddp_collectives`).
- ZeRO-1 (`zero1`: DDP + torch's ZeroRedundancyOptimizer): DDP's all-reduce of the trainable
  gradients, then one broadcast per rank of its partition of the updated trainable weights (every
  rank takes part in all N: the weights' bytes once, not overlapped).
- FSDP2: per micro-batch an all-gather of every parameter (twice for ZeRO-3: forward and again in
  backward; once for ZeRO-2) and a reduce-scatter of the trainable gradients. Frozen weights
  travel too: LoRA under FSDP moves the whole base model every micro-batch.
- HSDP: FSDP2's traffic inside each shard group (a node), and once per step an all-reduce of each
  rank's gradient shard (1/shard of the padded gradients) across the replicas. In a pipeline
  (`fsdp+pp`, `fsdp+tp+pp`) FSDP2 gathers and reduces once per step: torch's stage keeps it
  gathered and defers the reduce-scatter to its last backward (`fsdp_pipeline_gathers`).
- CP (`cp`): per layer and micro-batch K and V of the whole sequence all-gathered, their
  gradients reduce-scattered; the gradients all-reduced once per step.
- TP+SP (`tp-sp`): per layer and micro-batch 2 all-gathers and 2 reduce-scatters of a
  (batch, seq, hidden) activation forward and as many backward (one fewer when nothing before
  the first block trains; without SP the same bytes as all-reduces); checkpointing repeats the
  forward ones; one all-reduce of the replicated weights' partial gradients per step.
- TP (`tp`, `fsdp+tp`'s: parallelize_module): all-reduces of (batch, seq, hidden): 2 per layer
  forward, 5 backward (one per column projection; 3 fewer in layer 0 with frozen embeddings) and,
  with LoRA, small (batch, seq, r) ones per adapter, as `parallel/tensor_parallel.py` counts.
- PP: a (batch, seq, hidden) send forward and one backward per micro-batch and stage boundary;
  full finetuning of a tied embedding adds an all-reduce of its gradient (its FSDP shard).
- FSDP x EP: FSDP2's traffic without the expert stacks; all-to-alls of routed tokens (`expert_traffic`).
Every weight counts by its shape (`ModelSpec.tensors`), the family's own included: Qwen2's q/k/v
biases travel with DDP's and FSDP's bytes (FSDP2 pads each on its own) and, split with their
weight's rows under TP, have complete gradients; Qwen3's q/k norms are TP's partial gradients.

Groups are laid out TP innermost, then data parallel (HSDP: its shard groups inside, its replicas
across), then pipeline; a group longer than a node crosses the inter-node link. Each collective
says whether it can overlap compute (`Collective.overlapped`): TP's sit on the critical path,
DDP's, FSDP's and a pipeline's sends overlap it (what that costs a step: `distft.plan.timing`).

Collective counts come from the runtime's own tables (`plan/counts.py`), shapes from a `ModelSpec`
and a `Training` (a running step's own micro-batches and `Strategy.traffic_facts`).
"""

from __future__ import annotations

import math
from dataclasses import replace

from distft.layout import SPECS
from distft.parallel.context.model import layers_without_kv_gradient, padded_length
from distft.plan import expert_traffic as experts
from distft.plan.collective import Collective, Topology, held_bytes
from distft.plan.counts import frozen_embedding, fsdp_gathers_per_microbatch, fsdp_pipeline_gathers
from distft.plan.hardware import Link
from distft.plan.inputs import (
    Parallelism,
    Training,
    compute_bytes,
    holds_first_stage,
    holds_last_stage,
    pipeline_layout,
    rank_layers,
)
from distft.plan.memory import stage_tensors
from distft.plan.model_spec import ModelSpec
from distft.plan.preference_traffic import (
    cp_forward_only,
    fsdp_forward_only_gathers,
    pp_forward_only_sends,
    sequence_sums,
)
from distft.plan.tp_traffic import tp_collectives

# ---- Per-collective formulas (bytes and calls per optimizer step, one rank) ---------------------


def ddp_collectives(
    spec: ModelSpec, training: Training, par: Parallelism, link: Link, rank: int = 0
) -> list[Collective]:
    """DDP: the trainable gradients all-reduced once per step (`no_sync` on every micro-batch but
    the last), and what its misconfiguration switches (`parallel.ddp_*`, `Parallelism.ddp`) add on
    the first step of a process:
    - `no_sync` off: every micro-batch's backward all-reduces; DDP rebuilds its buckets before the
      first forward after a synced backward, rank 0 broadcasting the layout (int32: the parameter
      order plus a count, and each bucket's size);
    - `find_unused`: per synced backward, an int32 all-reduce of the used-parameter bitmap (one
      entry per trainable tensor); DDP then never rebuilds its buckets;
    - `broadcast_buffers`: rank 0's buffers before each forward that follows a synced backward."""
    d = par.ddp
    synced = 1 if d.no_sync else par.microbatches  # backwards that all-reduce
    grads = held_bytes(spec, training, par, "gradients", rank)
    tensors = sum(trains for _, trains in stage_tensors(spec, training, par, rank))
    out = [Collective("gradients", "all_reduce", synced * grads, synced, par.dp, link, True)]
    if d.find_unused:
        out.append(
            Collective("used parameters", "all_reduce", synced * 4 * tensors, synced, par.dp, link, False)
        )
    if d.broadcast_buffers:
        out.append(Collective("buffers", "broadcast", synced * d.buffer_bytes, synced, par.dp, link, False))
    if synced > 1 and not d.find_unused and not d.static_graph:
        layout = 4 * (tensors + 1) + 4 * d.buckets
        out.append(Collective("bucket layout", "broadcast", layout, 2, par.dp, link, False))
    return out


def dp_collectives(
    spec: ModelSpec, training: Training, par: Parallelism, link: Link, layers: int, rank: int = 0
) -> list[Collective]:
    """DDP's gradient all-reduce, ZeRO-1's all-reduce + broadcasts, FSDP2's per-unit traffic (over
    one shard group under HSDP: `link` is its link; `replica_collectives` adds the rest)."""
    if par.shard in ("none", "optimizer"):
        out = ddp_collectives(spec, training, par, link, rank)
        if par.shard == "optimizer":  # every rank takes part in each rank's broadcast
            weights = held_bytes(spec, training, par, "trained", rank)
            out.append(Collective("updated weights", "broadcast", weights, par.dp, par.dp, link, False))
        return out
    grads = held_bytes(spec, training, par, "gradients", rank)
    m, n = par.microbatches, par.shard_degree
    if par.pp > 1:  # fsdp+pp, fsdp+tp+pp: torch's stage gathers once and reduces once per step
        if par.stage_gathers:  # a running schedule's own count, stage by stage
            params = sum(
                g * held_bytes(spec, training, par, "gathered", rank, s) for s, g in par.stage_gathers
            )
            gathers = max(g for _, g in par.stage_gathers)
        else:
            gathers = fsdp_pipeline_gathers(par.virtual_stages)
            params = held_bytes(spec, training, par, "gathered", rank) * gathers
        return [
            Collective("parameters", "all_gather", params, (layers + 1) * gathers, par.dp, link, True),
            Collective("gradients", "reduce_scatter", grads, layers + 1, par.dp, link, True),
        ]
    gathers = fsdp_gathers_per_microbatch(par.reshard_after_forward)
    params = held_bytes(spec, training, par, "gathered", rank) * gathers * m
    calls = (layers + 1) * gathers * m  # every unit (layers + root) in forward, again in backward for ZeRO-3
    if layers:  # a preference objective's forwards without backward
        extra, extra_calls = fsdp_forward_only_gathers(spec, training, par, rank, layers)
        params, calls = params + extra, calls + extra_calls
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


def cp_collectives(spec: ModelSpec, training: Training, par: Parallelism, link: Link) -> list[Collective]:
    """Context parallelism, per micro-batch and layer (again where checkpointing recomputes the
    layer's attention). allgather: K and V of the whole (padded) sequence all-gathered, dK and dV
    reduce-scattered back where the keys need a gradient. ring: this rank's K and V sent on N-1
    times forward and N-1 times backward, beside N hops of their fp32 gradient where the keys need
    one. Replicated weights (`cp`): once per step, the gradients summed."""
    shapes, layers, n = training.shapes(par.microbatches), spec.num_layers, par.cp
    c = 2 if training.autocast else training.precision.activation  # K, V in bf16 under autocast
    positions = sum(rows * padded_length(seq, n) for rows, seq in shapes)
    kv = 2 * c * positions * spec.num_kv_heads * spec.head_dim  # one layer's K and V, every micro-batch
    forwards = layers * (2 if training.activation_checkpointing in ("full", "offload") else 1)
    m, frozen = len(shapes), frozen_embedding(spec, training)
    backward = layers - layers_without_kv_gradient(frozen, set(training.lora_targets))
    if par.cp_method == "ring":  # kv / n: this rank's share, passed on; its gradient in fp32
        local = kv // n
        passes = (n - 1) * local * (forwards + layers) + n * (local * 4 // c) * backward
        calls = m * (2 * (n - 1) * (forwards + layers) + 2 * n * backward)  # a K and a V tensor each
        out = [
            Collective("keys, values (ring)", kind, passes, calls, n, link, True) for kind in ("send", "recv")
        ]
    else:
        out = [
            Collective("keys, values", "all_gather", kv * forwards, m * forwards, n, link, False),
            Collective("key, value gradients", "reduce_scatter", kv * backward, m * backward, n, link, False),
        ]
    out += cp_forward_only(training, par, link, 2 * c * spec.num_kv_heads * spec.head_dim, layers)
    if training.pair_statistics:  # each sequence's log-probability and count, summed over the ranks
        out.append(sequence_sums(training, par, link, par.cp))
    out += experts.cp_router_sums(spec, par, link, m)  # an MoE's, pooled over the ranks' tokens
    # Replicated weights: the positions' shares summed (FSDP's reduce-scatter does it).
    if par.shard == "none":
        grads = held_bytes(spec, training, par, "gradients")
        out.append(Collective("gradients", "all_reduce", grads, 1, n, link, False))
    return out


def pp_collectives(
    spec: ModelSpec, training: Training, par: Parallelism, link: Link, rank: int = 0
) -> list[Collective]:
    """Stage-boundary sends and receives of the (batch, seq, hidden) hidden states, forward and
    backward per micro-batch (in FSDP2's output dtype, else its param dtype, where set), and, on
    the ranks holding a copy, the tied embedding's gradient."""
    sent = (par.shard == "full" and training.fsdp_output_bytes) or compute_bytes(training, par)
    positions = sum(rows * seq for rows, seq in training.shapes(par.microbatches))
    lay = pipeline_layout(spec, training, par)
    boundaries = lay.boundaries_of(rank)  # each way
    nbytes = boundaries * sent * positions * spec.hidden_size / (par.tp if par.sp else 1)
    messages = par.microbatches * boundaries  # each way
    out = [
        Collective("stage activations", kind, nbytes, messages, 2, link, True) for kind in ("send", "recv")
    ]
    out += experts.pp_router_sums(spec, par, link, boundaries)  # an MoE's, beside the hidden states
    sends = lay.sends_of(rank)  # KTO's KL term: forward only, each way as this rank holds the stages
    out += pp_forward_only_sends(spec, training, par, link, sends, boundaries - sends, sent)
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
    without a pipeline: their bytes are equal), each named by its mesh dimension. Groups: TP
    innermost, then DP (HSDP: shard groups of neighbouring ranks, replicas `shard` groups apart),
    then PP; a group of every rank is the default one, which a run's counter names "world"."""
    layers = len(rank_layers(spec, training, par, rank))
    out: list[Collective] = []

    def add(dim: str, collectives: list[Collective]) -> None:
        out.extend(replace(c, dim=dim) for c in collectives)

    dp_dim = "shard" if par.dp_shard else "world" if par.shard_degree == par.world else "dp"
    if par.shard_degree > 1:  # data parallel, or FSDP over the context-parallel ranks too
        link = topo.link(par.shard_degree, par.tp)
        add(dp_dim, dp_collectives(spec, training, par, link, layers, rank))
    if par.replicas > 1:
        link = topo.link(par.replicas, par.tp * par.shard_degree)
        add("replicate", replica_collectives(spec, training, par, link, layers, rank))
    if par.tp > 1:
        add("tp", tp_collectives(spec, training, par, topo.link(par.tp, 1), layers, rank))
    if par.pp > 1:
        add("pp", pp_collectives(spec, training, par, topo.link(par.pp, par.tp * par.dp), rank))
    if par.cp > 1:
        add("cp", cp_collectives(spec, training, par, topo.link(par.cp, 1)))
    out += experts.ep_collectives(spec, training, par, topo, rank, dp_dim) if par.ep > 1 else []  # fsdp+ep
    sequence_split = par.tp > 1 and par.tensor_parallel == "megatron" and par.sp
    # An MoE's router sums (`distft.model.router`) join a preference objective's in one all-reduce.
    statistics = training.pair_statistics + (3 + spec.num_layers * spec.num_experts if spec.moe else 0)
    loss, norm = SPECS[par.name].step_scalars(par.dp, sequence_split, statistics, training.kl_forwards > 0)
    if par.world > 1 and par.tensor_parallel == "dtensor" and par.pp == 1 and par.dp > 1 and loss:
        # TP ranks share one loss: summed over the data-parallel ranks only (`fsdp_tp.reduce_loss`).
        link = topo.link(par.dp, par.tp)
        add("dp", [Collective("loss", "all_reduce", sum(loss), len(loss), par.dp, link, False)])
        loss = ()
    if par.world > 1 and loss + norm:
        link, scalars, what = topo.link(par.world, 1), loss + norm, "loss, gradient norm"
        add("world", [Collective(what, "all_reduce", sum(scalars), len(scalars), par.world, link, False)])
    return out
