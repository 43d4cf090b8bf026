"""Counts behind the expected bytes: FSDP's units and gathers, TP's activation all-reduces,
tp-sp's crossings of the sequence-parallel boundary. `measure/expected.py` builds its formulas on
them, and `distft plan` (`plan/traffic.py`) shares those it can make without a model (FSDP's
gathers, TP's all-reduce calls, the crossings), so the planner and the bytes a run measures cannot disagree.
"""

from __future__ import annotations

import torch
from torch import nn

from distft.config import Config
from distft.model.nf4 import is_nf4, nf4_gather_bytes
from distft.parallel import Batch
from distft.parallel.fsdp import mixed_precision
from distft.parallel.megatron import PLAN
from distft.parallel.tensor_parallel import COLUMN, ROW


def fsdp_unit_bytes(
    cfg: Config, model: nn.Module, n: int, microbatches: int, reshard_after_forward: bool
) -> dict[str, int]:
    """FSDP2 over `n` ranks: all-gathers of every unit's parameters and reduce-scatters of the
    trainable gradients, each padded to a multiple of n rows, in the `MixedPrecisionPolicy`'s dtypes."""
    policy = mixed_precision(cfg)

    def padded_bytes(p: torch.Tensor, dtype: torch.dtype | None) -> int:
        if is_nf4(p):  # codes, block scales and group factors (never padded)
            return nf4_gather_bytes(p, n)
        return padded_rows(p.shape, n) * (dtype or p.dtype).itemsize

    params = list(model.parameters())  # every unit's parameters: layers and root
    gathers = fsdp_gathers_per_microbatch(reshard_after_forward)
    return {
        "all_gather": microbatches * gathers * sum(padded_bytes(p, policy.param_dtype) for p in params),
        "reduce_scatter": microbatches
        * sum(padded_bytes(p, policy.reduce_dtype) for p in params if p.requires_grad),
    }


def fsdp_gathers_per_microbatch(reshard_after_forward: bool) -> int:
    """All-gathers of each FSDP unit per micro-batch: before its forward, and again before its
    backward when it was resharded after the forward (ZeRO-3); ZeRO-2 keeps it gathered."""
    return 2 if reshard_after_forward else 1


def fsdp_pipeline_gathers(stages_per_rank: int) -> int:
    """All-gathers of each FSDP unit per optimizer step inside a pipeline (fsdp+pp, fsdp+tp+pp): one.
    A stage stays gathered from its first forward to the step's end (no reshard after forward, and
    torch's stage turns resharding after backward off until its last backward); the multi-stage
    schedules unshard a stage ahead of its compute and keep up to 3 stages gathered (torch's
    `_add_unshard_reshard`), so with V <= 3 stages per rank none is dropped and gathered again. The
    runtime reads its schedule's UNSHARD actions instead (`FSDPPipelineParallel.gathers_per_step`)."""
    if stages_per_rank > 3:
        raise ValueError(f"{stages_per_rank} stages per rank: torch may regather a stage within a step")
    return 1


def tp_activation_bytes(
    cfg: Config,
    lm: nn.Module,
    batches: list[Batch],
    layers: int | None = None,
    input_needs_grad: bool = False,
    itemsize: int | None = None,
) -> int:
    """Bytes TP all-reduces for `batches` (this rank's micro-batches) through `layers` decoder layers
    (default: all; a pipeline stage: its own): `tp_activation_calls` of a (batch, seq, hidden)
    activation per micro-batch, plus, with LoRA, one (batch, seq, r) all-reduce per adapter on a row
    projection (after its lora_A) and per column projection (backward, the input of its lora_B)."""
    hidden = lm.config.hidden_size
    n_layers = lm.config.num_hidden_layers if layers is None else layers
    lora = cfg.train.method in ("lora", "qlora")
    targets = set(cfg.lora.target_modules) if lora else set()
    adapters = tp_adapter_calls(n_layers, targets, cfg.model.activation_checkpointing)
    calls = tp_activation_calls(n_layers, lora, cfg.model.activation_checkpointing, input_needs_grad)
    itemsize = itemsize or next(lm.parameters()).element_size()  # the activations' dtype
    tokens = sum(b["input_ids"].numel() for b in batches)
    return itemsize * tokens * (hidden * calls + cfg.lora.rank * adapters)


# Per layer, the row projections whose forward (and its all-reduce) reruns in backward under each
# `model.activation_checkpointing` level: the whole layer's two, or the MLP's down_proj alone.
RECOMPUTED_ROW_PROJECTIONS = {
    "none": (),
    "selective": ("down_proj",),
    "full": ("o_proj", "down_proj"),
    "offload": ("o_proj", "down_proj"),
}


def tp_adapter_calls(layers: int, targets: set[str], checkpointing: str) -> int:
    """parallelize_module TP with LoRA, per micro-batch: all-reduces of a (B, S, r) adapter
    activation, one per adapter on a row projection (forward, after its lora_A; again when
    recomputed) and per adapter on a column projection (backward, the input of its lora_B)."""
    projections = [path.split(".")[-1] for path in (*COLUMN, *ROW)]
    recomputed = RECOMPUTED_ROW_PROJECTIONS[checkpointing]
    return layers * (sum(n in targets for n in projections) + sum(n in targets for n in recomputed))


def tp_activation_calls(layers: int, lora: bool, checkpointing: str, input_needs_grad: bool = False) -> int:
    """parallelize_module TP, per micro-batch: all-reduces of a (B, S, h) activation, 2 per layer
    forward (after the row projections) and 5 backward (one per column projection's input), 3 fewer
    in the first layer when nothing before it trains (LoRA; a later pipeline stage's input always
    needs its gradient, to send back); checkpointing repeats the forward ones it recomputes.
    `distft plan` counts with the same function."""
    recomputed = len(RECOMPUTED_ROW_PROJECTIONS[checkpointing]) * layers
    return 2 * layers + recomputed + 5 * layers - (3 if lora and not input_needs_grad else 0)


def megatron_crossings(
    layers: int, lora: bool, targets: set[str], checkpointing: str
) -> tuple[int, int, int, int]:
    """Megatron TP(+SP), per micro-batch: (block entries, exits, entries with a backward, exits with
    a backward) over all layers. Each layer has 2 blocks (attention, MLP), each entered and left
    once forward; an entry runs backward only if something before it trains, an exit only if its
    block's output needs a gradient; a checkpointed layer repeats its forward crossings. `distft
    plan` counts with the same function."""
    blocks = [{path.rsplit(".", 1)[1] for path in PLAN if path.startswith(p)} for p in ("self_attn", "mlp")]
    needs_grad = not lora  # full finetuning: the embeddings train
    enters_bwd = leaves_bwd = recomputed = 0
    for _ in range(layers):
        for block in blocks:
            enters_bwd += needs_grad
            needs_grad = needs_grad or bool(block & targets)
            leaves_bwd += needs_grad
        recomputed += needs_grad and checkpointing != "none"  # tp-sp recomputes whole layers
    crossings = 2 * layers + 2 * recomputed
    return crossings, crossings, enters_bwd, leaves_bwd


def padded_rows(shape: torch.Size, n: int) -> int:
    """Elements of a tensor whose dim 0 FSDP2 pads to a multiple of `n` ranks."""
    rows = -(-shape[0] // n) * n
    return rows * (shape.numel() // shape[0])
