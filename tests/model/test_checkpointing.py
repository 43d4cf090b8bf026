"""`model.activation_checkpointing`: every level trains the same gradients, and each keeps less.

Measured with `SavedActivations` (the bytes autograd keeps for backward, outside what the offload
hooks take) on the `micro` preset's real forward, LoRA and full finetuning, eager and compiled
(aot_eager, as the CPU runs `torch.compile`). Then under the strategies that meet the levels in
their own code, on real gloo groups: FSDP's gathers around an offloaded layer, the DTensor TP plan
rerunning the MLP's all-reduce (selective), the pipeline's stages and the Megatron layers' own
loop (offload): each resumes the single process's run at step 1 with the level on and trains
step 2 like it, moving the bytes its formula and the planner count.
"""

from __future__ import annotations

import json

import pytest
import torch

import distft.model.lm as lm_module
from distft.config import load_config
from distft.measure.activations import SavedActivations
from distft.model import LossLM, apply_method, causal_lm, load_base_model
from distft.model.checkpointing import HostOffload, enable_checkpointing
from distft.model.compile import compile_blocks
from tests.helpers import assert_same_training, distft
from tests.model.test_loss import PeakBytes
from tests.parallel.test_families import SETTINGS, resume_step_2

B, S = 2, 96


def model_at(level: str, method: str, compiled: bool = False) -> LossLM:
    cfg = load_config(None, ["model.name=micro", f"train.method={method}", "lora.rank=4"])
    torch.manual_seed(0)
    lm = apply_method(load_base_model(cfg.model), cfg)
    enable_checkpointing(causal_lm(lm), level)
    if compiled:
        compile_blocks(lm, "aot_eager", strict=True)
    model = LossLM(lm)
    model.train()
    return model


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    labels = torch.full((B, S), -100)
    labels[:, -20:] = torch.randint(0, 1000, (B, 20), generator=g)
    return {"input_ids": torch.randint(0, 1000, (B, S), generator=g), "labels": labels}


def step(model: LossLM, data: dict) -> tuple[float, int, dict[str, torch.Tensor], list[HostOffload]]:
    """Loss, saved bytes, gradients, and the offload hooks the forward installed."""
    installed: list[HostOffload] = []

    class Recorded(HostOffload):
        def __init__(self):
            super().__init__()
            installed.append(self)

    lm_module.HostOffload, original = Recorded, lm_module.HostOffload
    try:
        with SavedActivations(model) as probe:
            loss = model(**data)
        loss.backward()
    finally:
        lm_module.HostOffload = original
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), probe.bytes, grads, installed


@pytest.mark.parametrize("method", ["lora", "full"])
def test_each_level_keeps_less_and_trains_the_same_gradients(method):
    data = batch()
    results = {
        level: step(model_at(level, method), data) for level in ("none", "selective", "full", "offload")
    }
    loss, _, grads, _ = results["none"]
    for level, (other_loss, _, other_grads, _) in results.items():
        assert other_loss == pytest.approx(loss, rel=1e-6), level
        assert other_grads.keys() == grads.keys(), level
        for name, g in grads.items():
            torch.testing.assert_close(other_grads[name], g, rtol=1e-5, atol=1e-7, msg=f"{level}: {name}")
    saved = {level: r[1] for level, r in results.items()}

    assert saved["none"] > saved["selective"] > saved["full"] > saved["offload"]
    # Selective drops the MLP's gate, up, SiLU and product, less the MLP input it keeps instead.
    intermediate = causal_lm(model_at("none", method).lm).config.intermediate_size
    assert saved["none"] - saved["selective"] >= 4 * B * S * (3 * intermediate - 32)
    # Offload: the hooks took exactly each layer's input (fp32, hidden 32), all that full keeps inside.
    offloaded = results["offload"][3]
    layers = 4
    assert len(offloaded) == 1 and offloaded[0].bytes == layers * B * S * 32 * 4
    assert saved["full"] - saved["offload"] == offloaded[0].bytes
    assert results["full"][3] == []  # no hooks below offload


def test_levels_under_compiled_blocks_train_the_eager_gradients():
    data = batch()
    _, _, eager, _ = step(model_at("none", "lora"), data)
    for level in ("selective", "offload"):
        _, _, compiled, hooks = step(model_at(level, "lora", compiled=True), data)
        assert compiled.keys() == eager.keys()
        for name, g in eager.items():
            torch.testing.assert_close(compiled[name], g, rtol=1e-4, atol=1e-6, msg=f"{level}: {name}")
        assert bool(hooks) == (level == "offload")


def test_a_tiled_mlp_lowers_the_peak_and_trains_the_same_gradients():
    """At 4,096 tokens the MLP's intermediates are the largest part of one layer's recomputation:
    in 8 checkpointed slices the peak of forward and backward (every tensor created, by storage)
    falls, under full checkpointing and alone, and the gradients are the untiled ones."""
    g = torch.Generator().manual_seed(2)
    data = {
        "input_ids": torch.randint(0, 1000, (1, 4096), generator=g),
        "labels": torch.full((1, 4096), -100),
    }
    data["labels"][:, -2:] = torch.randint(0, 1000, (1, 2), generator=g)  # a small head: layers count
    results = {}
    for level, tiles in (("full", 0), ("full", 8), ("none", 0), ("none", 8)):
        model = model_at(level, "lora")
        enable_checkpointing(causal_lm(model.lm), "none", tiles)  # the tiles on top of the level
        with PeakBytes(*model.parameters()) as probe:
            model(**data).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results[level, tiles] = probe.peak, grads
    for level in ("full", "none"):
        (whole, want), (tiled, got) = results[level, 0], results[level, 8]
        print(f"{level}: peak {whole:,} B whole, {tiled:,} B in 8 tiles ({tiled / whole:.2f}x)")
        assert tiled < 0.8 * whole, (level, tiled, whole)
        for name, grad in want.items():
            # The weight gradients summed tile by tile: equal but for the order of the additions.
            assert (got[name] - grad).norm() <= 1e-5 * grad.norm() + 1e-9, (level, name)


def test_true_and_false_read_as_full_and_none():
    assert load_config(None, ["model.activation_checkpointing=true"]).model.activation_checkpointing == "full"
    assert (
        load_config(None, ["model.activation_checkpointing=false"]).model.activation_checkpointing == "none"
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Qwen3's micro, one process, no checkpointing: 2 steps, a checkpoint after step 1."""
    out = tmp_path_factory.mktemp("single")
    distft("train", "--model", "micro", *SETTINGS, "--checkpoint-every", "1", "--out", str(out))
    return out


@pytest.mark.parametrize(
    ("strategy", "level"),
    [("fsdp", "offload"), ("tp", "selective"), ("pp", "selective"), ("tp-sp", "offload")],
)
def test_strategies_train_like_one_process_at_a_level(strategy, level, reference, tmp_path):
    resume_step_2(reference, tmp_path / "run", strategy, f"model.activation_checkpointing={level}")
    assert_same_training(tmp_path / "run", reference)
    # Every rank records the activations it kept beside the planner's, and offload's host bytes.
    for rank in json.loads((tmp_path / "run" / "ranks.json").read_text()):
        acts = rank["activations"]
        assert acts["measured_saved_bytes"] > 0 and acts["predicted_saved_bytes"] > 0, (strategy, acts)
        assert (acts["predicted_host_bytes"] > 0) == (level == "offload"), (strategy, acts)
