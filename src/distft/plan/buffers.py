"""Communication buffers, the fifth component of a rank's memory (`memory.py` has the other four):
what is gathered or unsharded for a moment of the step, at its fullest. FSDP2's gathered units
and unsharded gradients, fsdp+ep's all-to-all buffers and, where its stacks are sharded across the
expert groups, one layer's gathered experts; TP/SP's and a pipeline's send/receive buffers; the
dequantized QLoRA weight."""

from __future__ import annotations

import math

from distft.plan.experts import all_to_all_buffer_bytes, expert_parallel, expert_shards
from distft.plan.inputs import Parallelism, Training
from distft.plan.memory import (
    layer_seq_len,
    local_shape,
    param_element_bytes,
    stage_tensors,
    trained_element_bytes,
)
from distft.plan.model_spec import ModelSpec, TensorSpec


def _unsharded(
    held: list[tuple[TensorSpec, bool]],
    training: Training,
    tp: int,
    trainable_only: bool = False,
    grad: bool = False,
    ep: int = 1,
) -> int:
    """Bytes of `held` gathered whole (this TP rank's slice, this EP rank's experts): weights, or
    gradients of the trainable."""
    total = 0.0
    for t, trains in held:
        if trainable_only and not trains:
            continue
        numel = math.prod(local_shape(t, tp, 0, ep))
        total += numel * (trained_element_bytes(t, training)[0] if grad else param_element_bytes(t, training))
    return int(total)


def _fsdp_buffers(
    held: list[tuple[TensorSpec, bool]], training: Training, par: Parallelism
) -> dict[str, int]:
    """FSDP2: gathered parameters (root unit, this layer and the prefetched ones; ZeRO-2 and the
    pipelines every layer) and the unsharded gradients before their reduce-scatter (a pipeline's
    stage accumulates every layer's until the step's end: torch's stage defers the reduction)."""
    by_layer: dict[int | None, list[tuple[TensorSpec, bool]]] = {}
    for t, trains in held:
        by_layer.setdefault(t.layer, []).append((t, trains))
    root = by_layer.pop(None, [])
    units = list(by_layer.values())
    biggest = max((_unsharded(u, training, par.tp) for u in units), default=0)
    biggest_grad = max((_unsharded(u, training, par.tp, True, True) for u in units), default=0)
    # FSDP2 keeps the root unit (embeddings, final norm, lm_head) gathered from forward to backward.
    gathered = _unsharded(root, training, par.tp)
    if par.reshard_after_forward:
        gathered += (1 + par.fsdp_prefetch) * biggest  # this layer and the prefetched ones
    else:
        gathered += sum(_unsharded(u, training, par.tp) for u in units)  # ZeRO-2: every layer until backward
    grads = (
        sum(_unsharded(u, training, par.tp, True, True) for u in units) if par.pp > 1 else 2 * biggest_grad
    )
    return {
        "gathered parameters": gathered,
        "unsharded gradients": grads + _unsharded(root, training, par.tp, True, True),
    }


def comm_buffer_bytes(
    spec: ModelSpec, training: Training, par: Parallelism, stage: int = 0
) -> dict[str, int]:
    """Transient buffers at the peak of a step, by what they hold (bytes, one rank)."""
    c, tp = training.precision.activation, par.tp
    held = stage_tensors(spec, training, par, stage)
    out: dict[str, int] = {}
    if par.shard == "full" and par.shard_degree > 1:
        fsdp = [(t, trains) for t, trains in held if not expert_parallel(t, par)]
        out.update(_fsdp_buffers(fsdp, training, par))
    if par.ep > 1:
        out["all-to-all buffers"] = all_to_all_buffer_bytes(spec, training, par)
    if expert_shards(par) > 1:  # one layer's expert stacks gathered, and their gradients before reduction
        stacks = [pair for pair in held if expert_parallel(pair[0], par)]
        layer = [pair for pair in stacks if pair[0].layer == stacks[0][0].layer]  # every MoE layer alike
        out["gathered experts"] = _unsharded(layer, training, tp, ep=par.ep) + _unsharded(
            layer, training, tp, True, True, par.ep
        )
    if tp > 1:
        out["TP collective buffers"] = (
            2 * c * training.micro_batch * layer_seq_len(training, par) * spec.hidden_size
        )
    if par.pp > 1:
        out["pipeline send/recv"] = 2 * c * training.micro_batch * training.seq_len * spec.hidden_size
    if training.method == "qlora":
        linear = [math.prod(local_shape(t, tp, 0)) for t, _ in held if t.kind == "linear"]
        out["dequantized NF4 weight"] = c * max(linear, default=0)
    return out
