"""How many collectives each mechanism runs: FSDP's gathers per micro-batch and per pipeline step,
TP's activation all-reduces, tp-sp's crossings of the sequence-parallel boundary. Read from the
runtime's own tables (the Megatron `PLAN`, parallelize_module's `COLUMN`/`ROW`), so the bytes
formula (`plan/traffic.py`) counts what the strategies run.
"""

from __future__ import annotations

from typing import NamedTuple

from distft.parallel.megatron import PLAN
from distft.parallel.tensor_parallel import COLUMN, ROW
from distft.plan.inputs import Training
from distft.plan.memory import trained_beside
from distft.plan.model_spec import ModelSpec


def frozen_embedding(spec: ModelSpec, training: Training) -> bool:
    """Whether nothing before the first layer trains, so that its input needs no gradient: LoRA
    with the embedding neither copied by `lora.modules_to_save` (a tied lm_head's copy is the
    embedding's) nor given trainable rows for added tokens."""
    return training.lora and not any(t.kind == "embed" for t in trained_beside(spec, training))


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


def tp_activation_calls(layers: int, frozen: bool, checkpointing: str, input_needs_grad: bool = False) -> int:
    """parallelize_module TP, per micro-batch: all-reduces of a (B, S, h) activation, 2 per layer
    forward (after the row projections) and 5 backward (one per column projection's input), 3 fewer
    in the first layer when nothing before it trains (`frozen_embedding`; a later pipeline stage's
    input always needs its gradient, to send back); checkpointing repeats the forward ones it
    recomputes. `distft plan` counts with the same function."""
    recomputed = len(RECOMPUTED_ROW_PROJECTIONS[checkpointing]) * layers
    return 2 * layers + recomputed + 5 * layers - (3 if frozen and not input_needs_grad else 0)


class Crossings(NamedTuple):
    """Megatron TP(+SP)'s block crossings per micro-batch, over all layers (`megatron_crossings`)."""

    enters: int  # block entries forward (a recomputed layer's again)
    leaves: int  # block exits forward
    enters_bwd: int  # entries whose input needs a gradient: a backward collective each
    leaves_bwd: int  # exits whose output needs a gradient
    mlp_enters_bwd: int  # of those entries, the MLP blocks' (an MoE's routing weights: `expert_traffic`)
    recomputed: int  # layers whose forward runs again in backward


def megatron_crossings(layers: int, frozen: bool, targets: set[str], checkpointing: str) -> Crossings:
    """Megatron TP(+SP), per micro-batch. Each layer has 2 blocks (attention, MLP), each entered
    and left once forward; an entry runs backward only if something before it trains, an exit only
    if its block's output needs a gradient; a checkpointed layer repeats its forward crossings.
    `distft plan` counts with the same function."""
    blocks = [{path.rsplit(".", 1)[1] for path in PLAN if path.startswith(p)} for p in ("self_attn", "mlp")]
    needs_grad = not frozen  # the embedding trains (`frozen_embedding`)
    enters_bwd = leaves_bwd = mlp_enters_bwd = recomputed = 0
    for _ in range(layers):
        for block in blocks:
            enters_bwd += needs_grad
            mlp_enters_bwd += needs_grad and block is blocks[1]
            needs_grad = needs_grad or bool(block & targets)
            leaves_bwd += needs_grad
        recomputed += needs_grad and checkpointing != "none"  # tp-sp recomputes whole layers
    crossings = 2 * layers + 2 * recomputed
    return Crossings(crossings, crossings, enters_bwd, leaves_bwd, mlp_enters_bwd, recomputed)
