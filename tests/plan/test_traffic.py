"""The planner's bytes per step equal the runtime's expected bytes (which the parity tests check
against what gloo ranks really moved) for the same model, batch and layout.

The runtime's formulas (`distft.measure.expected`) sum the tensors a built model holds; the
planner's (`distft.plan.traffic`) multiply shapes from a `ModelSpec`. Both are evaluated here on
every family's micro model (Qwen3's q/k norms, Qwen2's biases, untied Llama and Mistral), in one
process: the runtime's need only a strategy's facts, given as a namespace.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from distft.config import load_config
from distft.measure import counts, expected
from distft.model import LossLM, apply_method, causal_lm, load_base_model
from distft.parallel import STRATEGIES
from distft.parallel.pipeline import Layout, StageModule
from distft.plan.hardware import Link
from distft.plan.inputs import PRECISIONS, Parallelism, Training, pipeline_layout, rank_layers
from distft.plan.model_spec import resolve_model
from distft.plan.traffic import dp_collectives, replica_collectives, tp_collectives
from tests.plan import MICROS

WORLD, RANK, SEQ, MICRO_BATCHES = 2, 5, 32, 3  # odd LoRA rank: FSDP2 pads lora_A's rows
LINK = Link("test", "a test link", bandwidth=1e9, efficiency=1.0, latency_s=0.0)


@functools.cache  # one build per model and method: the formulas only read it
def _built(method: str, preset: str):
    cfg = load_config(None, [f"model.name={preset}", f"train.method={method}", f"lora.rank={RANK}"])
    torch.manual_seed(0)
    return cfg, LossLM(apply_method(load_base_model(cfg.model), cfg))


def _training(method: str) -> Training:
    return Training(method=method, precision=PRECISIONS["fp32"], lora_rank=RANK, seq_len=SEQ, autocast=False)


def _stage_0_layers(method: str, preset: str, layout: Parallelism) -> range:
    """The layers of stage 0 as the planner cuts the pipeline (parallel.pp_split=balanced: the
    runtime's cut, `distft.parallel.pipeline.cost`)."""
    return pipeline_layout(resolve_model(preset), _training(method), layout).layers_of(0)


def _planned(
    method: str, preset: str, layout: Parallelism, dimension: str | None = None, collectives=None
) -> dict[str, float]:
    """The planner's bytes of rank 0 along `dimension` (default: dp if there is one, else tp), or
    from `collectives` (HSDP's replicate dimension)."""
    spec, training = resolve_model(preset), _training(method)
    layers = len(rank_layers(spec, training, layout, 0))  # pipeline rank 0's, or all
    if collectives is None:
        dim = dimension or ("dp" if layout.dp > 1 else "tp")
        collectives = dp_collectives if dim == "dp" else tp_collectives
    out: dict[str, float] = {}
    for c in collectives(spec, training, layout, LINK, layers):
        if c.what in ("gradients", "parameters", "activations", "updated weights", "gradient shards"):
            out[c.kind] = out.get(c.kind, 0) + c.logical_bytes
    return out


def _facts(strategy: str, **facts) -> SimpleNamespace:
    """What a runtime formula reads of a built strategy: its scalars' rule, its data-parallel degree."""
    return SimpleNamespace(step_scalars=STRATEGIES[strategy].step_scalars, dp_size=WORLD, **facts)


def _batches() -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": torch.zeros(1, SEQ, dtype=torch.long)} for _ in range(MICRO_BATCHES)]


@pytest.mark.parametrize("preset", MICROS)
@pytest.mark.parametrize("method", ["lora", "full"])
def test_ddp_gradients(preset, method):
    cfg, model = _built(method, preset)
    runtime = (
        expected.ddp(_facts("ddp", cfg=cfg), model, _batches())["all_reduce"] - 4
    )  # less the loss scalar
    planned = _planned(method, preset, Parallelism("ddp", dp=WORLD, microbatches=MICRO_BATCHES))
    assert planned == {"all_reduce": runtime}


@pytest.mark.parametrize("preset", MICROS)
@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("reshard", [True, False], ids=["zero3", "zero2"])
def test_fsdp_gathers_and_scatters(preset, method, reshard):
    cfg, model = _built(method, preset)
    facts = _facts("fsdp", cfg=cfg, env=SimpleNamespace(world_size=WORLD), reshard_after_forward=reshard)
    runtime = expected.fsdp(facts, model, _batches())
    layout = Parallelism(
        "fsdp", dp=WORLD, shard="full", reshard_after_forward=reshard, microbatches=MICRO_BATCHES
    )
    planned = _planned(method, preset, layout)
    assert planned == {"all_gather": runtime["all_gather"], "reduce_scatter": runtime["reduce_scatter"]}


@pytest.mark.parametrize("preset", MICROS)
@pytest.mark.parametrize("method", ["lora", "full"])
def test_tp_activations(preset, method):
    cfg, model = _built(method, preset)
    runtime = counts.tp_activation_bytes(cfg, causal_lm(model.lm), _batches())
    planned = _planned(
        method, preset, Parallelism("tp", tp=WORLD, tensor_parallel="dtensor", microbatches=MICRO_BATCHES)
    )
    assert planned == {"all_reduce": runtime}


@pytest.mark.parametrize("preset", MICROS)
@pytest.mark.parametrize("method", ["lora", "full"])
def test_zero1_all_reduce_and_broadcasts(preset, method):
    cfg, model = _built(method, preset)
    runtime = expected.zero1(_facts("zero1", cfg=cfg), model, _batches())
    planned = _planned(
        method, preset, Parallelism("zero1", dp=WORLD, shard="optimizer", microbatches=MICRO_BATCHES)
    )
    assert planned == {"all_reduce": runtime["all_reduce"] - 4, "broadcast": runtime["broadcast"]}


@pytest.mark.parametrize("preset", MICROS)
@pytest.mark.parametrize("method", ["lora", "full"])
def test_hsdp_bytes_per_mesh_dimension(preset, method):
    """HSDP over 2 shard groups of 2: the shard dimension's gathers and scatters (padded to 2 rows),
    the replicate dimension's all-reduce of the gradient shards."""
    cfg, model = _built(method, preset)
    runtime = expected.hsdp_by_dim(_facts("hsdp", cfg=cfg, shard=WORLD), model, _batches())
    layout = Parallelism("hsdp", dp=2 * WORLD, shard="full", dp_shard=WORLD, microbatches=MICRO_BATCHES)
    assert _planned(method, preset, layout) == runtime["shard"]
    assert _planned(method, preset, layout, collectives=replica_collectives) == runtime["replicate"]


@pytest.mark.parametrize("preset", MICROS)
@pytest.mark.parametrize("method", ["lora", "full"])
def test_fsdp_pipeline_gathers_and_scatters_once_per_step(preset, method):
    """fsdp+pp, stage 0 of 2 (the embedding and its layers, 0-2 of 4 as the balanced cut takes
    them): its units gathered once per step and its trainable gradients reduce-scattered once,
    whatever the micro-batch count: torch's stage keeps the stage gathered and defers the
    reduction to its last backward."""
    cfg, model = _built(method, preset)
    layout = Parallelism(
        "fsdp+pp", dp=WORLD, pp=2, shard="full", reshard_after_forward=False, microbatches=MICRO_BATCHES
    )
    layers = _stage_0_layers(method, preset, layout)
    assert len(layers) == 3  # lm_head on 32 labelled positions outweighs micro's layers
    lay = Layout("1f1b", 2, 1, MICRO_BATCHES, 1, (len(layers), 4 - len(layers)))
    stage = StageModule(model.backbone, model.lm_head, lay.layers_of(0), first=True, last=False)
    facts = _facts(
        "fsdp+pp",
        cfg=cfg,
        dims=SimpleNamespace(dp=WORLD, tp=1),
        layout=lay,
        pp_rank=0,
        tied_weight=None,
        stages=[SimpleNamespace(stage_index=0, submod=stage)],
        stage_params={0: [(p.shape, p.dtype, p.requires_grad) for p in stage.parameters()]},
        gathers_per_step=lambda stage: 1,
    )
    runtime = expected.fsdp_pipeline(facts, SimpleNamespace(module=model), _batches())
    planned = _planned(method, preset, layout)
    assert planned == {"all_gather": runtime["all_gather"], "reduce_scatter": runtime["reduce_scatter"]}


@pytest.mark.parametrize("preset", MICROS)
@pytest.mark.parametrize("method", ["lora", "full"])
def test_tp_inside_a_pipeline_stage(preset, method):
    """fsdp+tp+pp, stage 0 of 2: TP's all-reduces for its own layers (rank 0's; the planner models
    rank 0), the first of which skips q, k and v's backward one under LoRA."""
    cfg, model = _built(method, preset)
    layout = Parallelism(
        "fsdp+tp+pp",
        dp=2,
        tp=WORLD,
        pp=2,
        shard="full",
        tensor_parallel="dtensor",
        microbatches=MICRO_BATCHES,
    )
    layers = len(_stage_0_layers(method, preset, layout))
    runtime = counts.tp_activation_bytes(cfg, causal_lm(model.lm), _batches(), layers=layers)
    assert _planned(method, preset, layout, dimension="tp") == {"all_reduce": runtime}
    # A later stage's input needs its gradient (it is sent back): 3 more per micro-batch with LoRA.
    later = counts.tp_activation_bytes(
        cfg, causal_lm(model.lm), _batches(), layers=layers, input_needs_grad=True
    )
    hidden = model.backbone.config.hidden_size
    assert later - runtime == (3 * MICRO_BATCHES * SEQ * hidden * 4 if method == "lora" else 0)
