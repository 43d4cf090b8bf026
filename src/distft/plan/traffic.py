"""Bytes each layout moves per optimizer step, over which link, and the compute they hide behind.

Per rank, per optimizer step of `Layout.microbatches` micro-batches (logical sizes, `distft.measure.comm`
convention; `hardware.wire_bytes` turns them into bytes on the wire):
- DDP: one all-reduce of the trainable gradients per step (bucketed, overlapping backward).
- ZeRO-1: a reduce-scatter of the gradients and an all-gather of the updated trainable weights.
- FSDP2: per micro-batch an all-gather of every parameter (twice for ZeRO-3: forward and again in
  backward; once for ZeRO-2) and a reduce-scatter of the trainable gradients. Frozen weights
  travel too: LoRA under FSDP moves the whole base model every micro-batch.
- TP+SP (`tp-sp`): per layer and micro-batch 2 all-gathers and 2 reduce-scatters of a
  (batch, seq, hidden) activation forward and as many backward (one fewer when nothing before
  the first block trains); without SP the same bytes as all-reduces. Checkpointing repeats the
  forward ones. Plus one all-reduce of the replicated weights' partial gradients per step.
- TP (`tp`, PyTorch's parallelize_module): all-reduces of (batch, seq, hidden): 2 per layer
  forward, 5 backward (one per column projection; 3 fewer in layer 0 with frozen embeddings)
  and, with LoRA, small (batch, seq, r) ones per adapter, as `parallel/tensor_parallel.py` counts.
- PP: a (batch, seq, hidden) send forward and one backward per micro-batch and stage boundary.

Groups are laid out TP innermost, then data parallel, then pipeline; a group longer than a node
crosses the inter-node link. Compute per rank: 2 FLOPs per weight per token forward (plus
attention's 2 B S^2 nq d per layer, causal), backward twice that for full finetuning and once
for LoRA (no weight gradients for the frozen base), one more forward with checkpointing;
divided by the GPU's dense bf16 peak times an assumed model-FLOPs utilisation (`mfu`).
Exposed communication: TP's collectives sit on the critical path; DDP's, ZeRO's and FSDP's
overlap compute and only the excess shows; a pipeline adds its bubble, (p - 1) / m of the
compute for GPipe and 1F1B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distft.plan.hardware import Link, comm_time, wire_bytes
from distft.plan.memory import (
    Layout,
    Training,
    _param_element_bytes,
    _seq,
    _trained_element_bytes,
    local_shape,
    stage_layers,
    stage_tensors,
)
from distft.plan.model_spec import COLUMN, ROW, ModelSpec


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


def _held_bytes(
    spec: ModelSpec, training: Training, layout: Layout, trainable_only: bool, grad: bool
) -> float:
    """Logical bytes of this rank's TP/PP slice of the model (FSDP2: including dim-0 padding)."""
    total = 0.0
    for t, trains in stage_tensors(spec, training, layout.pp, 0):
        if trainable_only and not trains:
            continue
        shape = local_shape(t, layout.tp, 0)
        numel = math.prod(shape)
        if layout.shard == "full" and layout.dp > 1 and shape[0]:
            numel = math.ceil(shape[0] / layout.dp) * layout.dp * (numel // shape[0])
        total += numel * (
            _trained_element_bytes(t, training)[0] if grad else _param_element_bytes(t, training)
        )
    return total


def step_collectives(spec: ModelSpec, training: Training, layout: Layout, topo: Topology) -> list[Collective]:
    p, c = training.precision, training.precision.activation
    m = layout.microbatches
    out: list[Collective] = []
    dp_link = topo.link(layout.dp, layout.tp)
    tp_link = topo.link(layout.tp, 1)
    lora = training.lora
    layers = len(stage_layers(spec.num_layers, layout.pp, 0))

    if layout.dp > 1:
        grads = _held_bytes(spec, training, layout, True, True)
        if layout.shard == "none":
            out.append(Collective("gradients", "all_reduce", grads, 1, layout.dp, dp_link, True))
        elif layout.shard == "optimizer":
            weights = _held_bytes(spec, training, layout, True, False)
            out.append(Collective("gradients", "reduce_scatter", grads, 1, layout.dp, dp_link, True))
            out.append(Collective("updated weights", "all_gather", weights, 1, layout.dp, dp_link, False))
        else:
            params = _held_bytes(spec, training, layout, False, False)
            gathers = 2 if layout.reshard_after_forward else 1
            units = layers + 1
            out.append(
                Collective(
                    "parameters",
                    "all_gather",
                    params * gathers * m,
                    units * gathers * m,
                    layout.dp,
                    dp_link,
                    True,
                )
            )
            out.append(
                Collective("gradients", "reduce_scatter", grads * m, units * m, layout.dp, dp_link, True)
            )

    if layout.tp > 1:
        T = training.micro_batch * _seq(training, layout)
        act = c * T * spec.hidden_size
        targets = set(training.lora_targets) if lora else set()
        recompute = layers if training.activation_checkpointing else 0
        if layout.tp_impl == "megatron":
            forward = 4 * (layers + recompute)  # 2 entries + 2 exits per layer
            backward = 4 * layers - (1 if lora else 0)
            if layout.sp:
                out.append(
                    Collective(
                        "activations",
                        "all_gather",
                        act * m * (forward + backward) / 2,
                        m * (forward + backward) // 2,
                        layout.tp,
                        tp_link,
                        False,
                    )
                )
                out.append(
                    Collective(
                        "activations",
                        "reduce_scatter",
                        act * m * (forward + backward) / 2,
                        m * (forward + backward) // 2,
                        layout.tp,
                        tp_link,
                        False,
                    )
                )
            else:
                calls = 2 * (layers + recompute) + 2 * layers - (1 if lora else 0)
                out.append(
                    Collective(
                        "activations", "all_reduce", act * m * calls, m * calls, layout.tp, tp_link, False
                    )
                )
        else:
            calls = 2 * (layers + recompute) + 5 * layers - (3 if lora else 0)
            adapters = layers * sum(n in targets for n in (*COLUMN, *ROW))
            logical = m * (act * calls + c * T * training.lora_rank * adapters)
            out.append(
                Collective(
                    "activations", "all_reduce", logical, m * (calls + adapters), layout.tp, tp_link, False
                )
            )
        partial = _partial_grad_bytes(spec, training, layout)
        if partial:
            out.append(Collective("partial gradients", "all_reduce", partial, 1, layout.tp, tp_link, False))

    if layout.pp > 1:
        boundary = (
            c
            * training.micro_batch
            * training.seq_len
            * spec.hidden_size
            / max(1, layout.tp if layout.sp else 1)
        )
        pp_link = topo.link(layout.pp, layout.tp * layout.dp)
        out.append(Collective("stage activations", "send", 2 * boundary * m, 2 * m, 2, pp_link, True))
        if spec.tie_word_embeddings and training.method == "full":
            tied = spec.vocab_size * spec.hidden_size * p.grad / layout.tp
            out.append(Collective("tied embedding gradient", "all_reduce", tied, 1, 2, pp_link, False))
    return out


def _partial_grad_bytes(spec: ModelSpec, training: Training, layout: Layout) -> float:
    """Replicated trainable weights whose gradients each TP rank has only in part (summed once per step)."""
    g = training.precision.grad
    layers = len(stage_layers(spec.num_layers, layout.pp, 0))
    if training.lora:
        total = 0
        for t in spec.lora_tensors(training.lora_rank, training.lora_targets):
            if t.tp_dim is None and t.layer in stage_layers(spec.num_layers, layout.pp, 0):
                total += t.numel
        return total * g
    qk = 2 * spec.head_dim * layers if spec.qk_norm else 0
    if layout.tp_impl == "megatron" and layout.sp:  # every replicated weight sees a sequence shard
        norms = 2 * spec.hidden_size * layers + spec.hidden_size
        embed = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
        return (qk + norms + embed) * g
    return qk * g


# ---------------------------------------------------------------------------------------------
# Compute
# ---------------------------------------------------------------------------------------------


def step_flops(spec: ModelSpec, training: Training, layout: Layout) -> float:
    """FLOPs one rank runs per optimizer step (its micro-batches, its share of the model)."""
    B, S = training.micro_batch, training.seq_len
    tokens = B * S
    layers = len(stage_layers(spec.num_layers, layout.pp, 0))
    linear = sum(o * i for o, i in spec.projection_shapes().values())
    forward = 2 * tokens * linear * layers / layout.tp
    forward += (
        2 * B * S * S * spec.num_heads * spec.head_dim * layers / layout.tp
    )  # causal: half of 4 B S^2 nq d
    labels = B * min(training.label_tokens, S)
    forward += 2 * labels * spec.vocab_size * spec.hidden_size / (layout.tp if layout.sp else 1)
    if training.lora:
        adapters = sum(t.numel for t in spec.lora_tensors(training.lora_rank, training.lora_targets))
        forward += 2 * tokens * adapters * layers / spec.num_layers / layout.tp
        backward = forward  # activation gradients only; adapter weight gradients are negligible
    else:
        backward = 2 * forward
    recompute = forward if training.activation_checkpointing else 0
    return (forward + backward + recompute) * layout.microbatches


def compute_seconds(flops: float, tflops: float | None, mfu: float) -> float | None:
    if not tflops:
        return None
    return flops / (tflops * 1e12 * mfu)


def bubble_fraction(layout: Layout) -> float:
    """Idle share a pipeline adds on top of compute: (p - 1) / m (interleaving divides it by v)."""
    if layout.pp == 1:
        return 0.0
    v = layout.virtual_stages if layout.schedule == "interleaved-1f1b" else 1
    return (layout.pp - 1) / (layout.microbatches * v)


def step_seconds(compute: float | None, collectives: list[Collective], layout: Layout) -> float | None:
    """Compute, the bubble, and the communication that does not hide behind compute."""
    if compute is None:
        return None
    blocking = sum(c.seconds for c in collectives if not c.overlapped)
    hidden = sum(c.seconds for c in collectives if c.overlapped)
    return compute * (1 + bubble_fraction(layout)) + blocking + max(0.0, hidden - compute)
