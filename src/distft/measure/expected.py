"""The bytes each strategy's collectives should move in one optimizer step, from first principles.

One function per strategy, in `distft.measure.comm`'s convention (the logical tensor each collective
carries, per rank, summed by kind). The strategies expose the facts (their groups, layouts, partial
gradients, what FSDP shards); the formulas live here. The tests check every one against the bytes
the `CommCounter` saw, to the byte, and `distft bench` prints both side by side.

Scalars every multi-rank step adds, the loss sum and the squared gradient norm, are the strategy's
own rule (`Strategy.step_scalars`), which the planner counts with too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from distft.measure.counts import (
    fsdp_gathers_per_microbatch,
    fsdp_unit_bytes,
    megatron_crossings,
    padded_rows,
    tp_activation_bytes,
)
from distft.model import causal_lm
from distft.model.nf4 import is_nf4, nf4_gather_bytes
from distft.parallel import Batch, Strategy
from distft.parallel.base import trainable_bytes, unwrap
from distft.parallel.context.model import layers_without_kv_gradient, padded_length
from distft.parallel.fsdp import mixed_precision
from distft.tensors import local_bytes

Formula = Callable[[Strategy, nn.Module, list[Batch]], dict[str, int]]


def expected_comm_bytes(strategy: Strategy, model: nn.Module, batches: list[Batch]) -> dict[str, int]:
    """Bytes per collective kind this rank should move in a step over `batches` (its micro-batches)."""
    return FORMULAS[strategy.name](strategy, model, batches)


def loss_only(s: Strategy, model: nn.Module, batches: list[Batch]) -> dict[str, int]:
    """single (nothing), or any data-parallel split: the loss, one fp32 scalar."""
    scalars = sum(s.step_scalars(s.dp_size)) if s.env.distributed else 0
    return {"all_reduce": scalars} if scalars else {}


def ddp(s: Strategy, model: nn.Module, batches: list[Batch]) -> dict[str, int]:
    """Every trainable gradient once per optimizer step (not per micro-batch), plus the loss; the
    misconfiguration switches (`parallel.ddp_*`) add what they cost, on the step measured (the
    first one of the process):
    - `ddp_no_sync=false`: every micro-batch's backward all-reduces the gradients; and since DDP
      rebuilds its buckets before the first forward that follows a synced backward, rank 0
      broadcasts the bucket layout (int32: the parameter order plus a count, and each bucket's size);
    - `ddp_find_unused_parameters`: per synced backward, an int32 all-reduce of the
      parameter-used bitmap (one entry per trainable tensor); DDP then never rebuilds its buckets;
    - `ddp_broadcast_buffers`: rank 0's buffers broadcast before each forward that follows a synced
      backward (or the construction): once per step, or every micro-batch without no_sync."""
    p = s.cfg.parallel
    synced = 1 if p.ddp_no_sync else len(batches)  # backwards that all-reduce; = forwards that sync
    trainable = [t for t in model.parameters() if t.requires_grad]
    out = {"all_reduce": synced * trainable_bytes(model) + sum(s.step_scalars(s.dp_size))}
    if p.ddp_find_unused_parameters:
        out["all_reduce"] += synced * 4 * len(trainable)
    broadcast = 0
    if p.ddp_broadcast_buffers:
        broadcast += synced * sum(b.numel() * b.element_size() for b in unwrap(model).buffers())
    if synced > 1 and not p.ddp_find_unused_parameters and not p.ddp_static_graph:
        buckets = len(model.reducer._get_zeros_like_grad_buckets())  # after the rebuild
        broadcast += 4 * (len(trainable) + 1) + 4 * buckets
    if broadcast:
        out["broadcast"] = broadcast
    return out


def zero1(s: Strategy, model: nn.Module, batches: list[Batch]) -> dict[str, int]:
    """DDP's traffic, then the optimizer step's broadcasts of the updated trainable weights: every
    rank takes part in each rank's broadcast, so it counts every trainable byte once."""
    out = ddp(s, model, batches)
    out["broadcast"] = out.get("broadcast", 0) + trainable_bytes(model)
    return out


def fsdp(s: Strategy, model: nn.Module, batches: list[Batch]) -> dict[str, int]:
    """Per micro-batch: all-gather every unit's parameters (twice under ZeRO-3: forward and
    backward; once under ZeRO-2) and reduce-scatter the trainable gradients."""
    out = fsdp_unit_bytes(s.cfg, model, s.env.world_size, len(batches), s.reshard_after_forward)
    return {**out, "all_reduce": sum(s.step_scalars(s.dp_size))}  # the loss and the gradient norm


def hsdp_by_dim(s: Strategy, model: nn.Module, batches: list[Batch]) -> dict[str, dict[str, int]]:
    """Per mesh dimension. "shard": FSDP's traffic inside each group of `s.shard` ranks (`fsdp`'s, at
    that degree). "replicate": once per step, the all-reduce of each rank's reduce-scattered
    gradient shard (its padded rows / shard) across the replicas. "world": the loss and the norm."""
    shard = s.shard
    inside = fsdp_unit_bytes(s.cfg, model, shard, len(batches), reshard_after_forward=True)
    dtype = mixed_precision(s.cfg).reduce_dtype
    shards = sum(
        padded_rows(p.shape, shard) // shard * (dtype or p.dtype).itemsize
        for p in model.parameters()
        if p.requires_grad
    )
    return {
        "shard": inside,
        "replicate": {"all_reduce": shards},
        "world": {"all_reduce": sum(s.step_scalars(s.dp_size))},
    }


def hsdp(s: Strategy, model: nn.Module, batches: list[Batch]) -> dict[str, int]:
    """`hsdp_by_dim`, summed over the dimensions."""
    out: dict[str, int] = {}
    for per_kind in hsdp_by_dim(s, model, batches).values():
        for kind, nbytes in per_kind.items():
            out[kind] = out.get(kind, 0) + nbytes
    return out


def tp(s: Strategy, model: nn.Module, batches: list[Batch]) -> dict[str, int]:
    """The activations' all-reduces, the partial gradients and the gradient norm."""
    activations = tp_activation_bytes(s.cfg, causal_lm(unwrap(model).lm), batches)
    return {"all_reduce": activations + local_bytes(s.partial_grads) + sum(s.step_scalars(s.dp_size))}


def fsdp_tp(s: Strategy, model: nn.Module, batches: list[Batch]) -> dict[str, int]:
    """FSDP over dp (two all-gathers and one reduce-scatter of the TP-local units per micro-batch;
    nothing moves over one rank), TP over tp (`tp_activation_bytes`), the loss, the gradient norm,
    full finetuning's partial gradients."""
    dp, policy = s.dims.dp, mixed_precision(s.cfg)
    param_dtype, reduce_dtype = policy.param_dtype, policy.reduce_dtype
    gathered = sum(
        padded_rows(shape, dp) * (param_dtype or dtype).itemsize for shape, dtype, _ in s.tp_local_params
    )
    scattered = sum(
        padded_rows(shape, dp) * (reduce_dtype or dtype).itemsize
        for shape, dtype, trains in s.tp_local_params
        if trains
    )
    activations = tp_activation_bytes(s.cfg, causal_lm(unwrap(model).lm), batches)
    sharded = {
        "all_gather": len(batches) * fsdp_gathers_per_microbatch(reshard_after_forward=True) * gathered,
        "reduce_scatter": len(batches) * scattered,
    }
    return {
        **(sharded if dp > 1 else {}),
        "all_reduce": activations + local_bytes(s.partial_grads) + sum(s.step_scalars(dp)),
    }


def megatron(s: Strategy, model: nn.Module, batches: list[Batch]) -> dict[str, int]:
    """Per micro-batch and layer, 2 block entries and 2 exits, each of an (S, B, H) activation, S
    padded to a multiple of N with SP: forward always; an entry's backward only if its input needs
    a gradient (something before it trains), an exit's only if its block's output does; a
    checkpointed layer runs its forward collectives again in backward. Plus one all-reduce of the
    partial gradients, the loss (SP) and the gradient norm."""
    lm = causal_lm(unwrap(model).lm)
    hidden, n, sp = lm.config.hidden_size, s.env.world_size, s.sequence_parallel
    lora = s.cfg.train.method == "lora"
    targets = set(s.cfg.lora.target_modules) if lora else set()
    enters, leaves, enters_bwd, leaves_bwd = megatron_crossings(
        len(lm.model.layers), lora, targets, s.cfg.model.activation_checkpointing
    )
    model_size = next(lm.parameters()).element_size()
    autocast = s.cfg.model.autocast and s.env.device.type == "cuda"
    compute_size = 2 if autocast else model_size  # projection outputs are bf16 under autocast
    tokens = 0
    for b in batches:
        batch, seq = b["input_ids"].shape
        tokens += batch * (seq + (-seq % n if sp else 0))
    # Entries carry norm outputs (model dtype) forward and their gradients back; exits carry
    # projection outputs (compute dtype), and their gradients back.
    enter_bytes, leave_bytes = tokens * hidden * model_size, tokens * hidden * compute_size
    partial = local_bytes(s.partial_grads)
    scalars = sum(s.step_scalars(s.dp_size, sequence_split=sp))
    if not sp:
        return {"all_reduce": leave_bytes * leaves + enter_bytes * enters_bwd + partial + scalars}
    return {
        "all_gather": enter_bytes * enters + leave_bytes * leaves_bwd,
        "reduce_scatter": leave_bytes * leaves + enter_bytes * enters_bwd,
        "all_reduce": partial + scalars,
    }


def context(s: Strategy, model: nn.Module, batches: list[Batch]) -> dict[str, int]:
    """Per micro-batch of B rows padded to S' (a multiple of 2N) and per layer: K and V of the whole
    row all-gathered, 2 B S' Hkv d in the compute dtype (again where checkpointing recomputes the
    layer), dK and dV reduce-scattered where the keys need a gradient; per step every trainable
    gradient all-reduced once, and the loss."""
    lm = causal_lm(unwrap(model).lm)
    config, world = lm.config, s.env.world_size
    autocast = s.cfg.model.autocast and s.env.device.type == "cuda"
    itemsize = 2 if autocast else next(lm.parameters()).element_size()
    level = s.cfg.model.activation_checkpointing
    lora = s.cfg.train.method in ("lora", "qlora")
    targets = set(s.cfg.lora.target_modules) if lora else set()
    frozen = layers_without_kv_gradient(lora, targets)
    layers = config.num_hidden_layers
    kv = sum(
        2 * b["input_ids"].shape[0] * padded_length(b["input_ids"].shape[1], world)
        * config.num_key_value_heads * config.head_dim * itemsize
        for b in batches
    )  # fmt: skip
    grads = local_bytes(p for p in model.parameters() if p.requires_grad)
    return {
        "all_gather": kv * layers * (2 if level in ("full", "offload") else 1),
        "reduce_scatter": kv * (layers - frozen),
        "all_reduce": grads + sum(s.step_scalars(1)),
    }


def pipeline(
    s: Strategy, model: nn.Module, batches: list[Batch], itemsize: int | None = None
) -> dict[str, int]:
    """Per micro-batch and stage boundary that crosses ranks: the hidden states forward, their
    gradient backward (`itemsize` bytes per element: the model's dtype unless FSDP computes in
    another); then the loss, the gradient norm and (full finetuning) a split tied embedding."""
    lay, me = s.layout, s.pp_rank
    hidden = model.module.backbone.config.hidden_size
    itemsize = itemsize or next(model.module.parameters()).element_size()
    rows, seq = batches[0]["input_ids"].shape  # (mb, seq) padded, (1, mb x seq) packed
    activation = rows * seq * hidden * itemsize  # one (rows, seq, hidden) tensor
    send = recv = lay.microbatches * activation * lay.boundaries_of(me)  # activations one way, gradients back
    all_reduce = sum(s.step_scalars(s.dp_size))  # the loss sum and the squared gradient norm
    if s.tied_weight is not None:
        all_reduce += local_bytes([s.tied_weight])  # fsdp+pp: this rank's shard of it
    out = {"all_reduce": all_reduce}
    if send:
        out["send"], out["recv"] = send, recv
    return out


@torch.no_grad()
def ddp_pipeline(s: Strategy, model: nn.Module, batches: list[Batch]) -> dict[str, int]:
    """pp's, plus, over dp, every trainable gradient of this rank's stages once."""
    out = pipeline(s, model, batches)
    out["all_reduce"] += trainable_bytes(model)
    return out


def fsdp_pipeline(s: Strategy, model: nn.Module, batches: list[Batch]) -> dict[str, int]:
    """pp's (sends, receives, loss, norm, a split tied embedding), plus, per stage this rank holds:
    over dp, its units' (TP-local) parameters all-gathered `gathers_per_step` times and its
    trainable gradients reduce-scattered once (nothing moves over one rank); over tp (3D), TP's
    activation all-reduces for the stage's layers and full finetuning's partial gradients."""
    dp, policy = s.dims.dp, mixed_precision(s.cfg)
    # FSDP's mixed precision: a stage computes in param_dtype and returns output_dtype, so the
    # hidden states (and TP's activations) travel in those.
    compute = policy.param_dtype.itemsize if policy.param_dtype else None
    sent = policy.output_dtype.itemsize if policy.output_dtype else compute
    out = pipeline(s, model, batches, itemsize=sent)
    gathered = scattered = 0
    for stage in s.stages:
        gathers = s.gathers_per_step(stage.stage_index)
        for (shape, dtype, trains), p in zip(
            s.stage_params[stage.stage_index], stage.submod.parameters(), strict=True
        ):
            if is_nf4(p):  # codes, block scales and group factors (never padded)
                gathered += gathers * nf4_gather_bytes(p, dp)
                continue
            gathered += gathers * padded_rows(shape, dp) * (policy.param_dtype or dtype).itemsize
            scattered += trains * padded_rows(shape, dp) * (policy.reduce_dtype or dtype).itemsize
    if dp > 1:
        out["all_gather"], out["reduce_scatter"] = gathered, scattered
    if s.dims.tp > 1:
        lm = causal_lm(model.module.lm)
        for stage in s.stages:
            layers, first = len(stage.submod.layers), stage.stage_index == 0
            out["all_reduce"] += tp_activation_bytes(s.cfg, lm, batches, layers, not first, compute)
        out["all_reduce"] += local_bytes(s.partial_grads)
    return out


FORMULAS: dict[str, Formula] = {
    "single": loss_only,
    "ddp": ddp,
    "zero1": zero1,
    "fsdp": fsdp,
    "zero2": fsdp,
    "hsdp": hsdp,
    "tp": tp,
    "tp-sp": megatron,
    "cp": context,
    "pp": pipeline,
    "fsdp+tp": fsdp_tp,
    "ddp+pp": ddp_pipeline,
    "fsdp+pp": fsdp_pipeline,
    "fsdp+tp+pp": fsdp_pipeline,
}


# Strategies whose collectives run over several mesh dimensions, bytes per dimension (as
# `CommStats.by_dim` names them).
PER_DIMENSION: dict[str, Callable[[Strategy, nn.Module, list[Batch]], dict[str, dict[str, int]]]] = {
    "hsdp": hsdp_by_dim,
}


def expected_comm_bytes_by_dim(
    strategy: Strategy, model: nn.Module, batches: list[Batch]
) -> dict[str, dict[str, int]] | None:
    """Bytes per mesh dimension and kind, for the strategies in `PER_DIMENSION` (None elsewhere)."""
    formula = PER_DIMENSION.get(strategy.name)
    return formula(strategy, model, batches) if formula else None
