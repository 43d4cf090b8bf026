"""The planner per model family: its tensors are the model transformers builds, its state bytes
what a built model holds, and the released sizes plan offline.

Every family's micro preset (`micro` is Qwen3's) is built in this process. The planner's tensor
list must be the model's parameters, name for name, shape for shape and in order (Qwen3's q/k
norms, Qwen2's q/k/v biases right after their weights, untied lm_heads), LoRA adapters included.
`state_bytes` of the single layout must equal the storage of the parameters, gradients and AdamW
state after one step, for LoRA, full finetuning and QLoRA (whose biases stay in the model dtype).
The activation tests (test_activations.py) run on every family's micro preset too; the bytes
formula against what gloo ranks moved, per family, is tests/parallel/test_families.py's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from distft.cli import main
from distft.config import load_config
from distft.model import PRESETS, LossLM, apply_method, load_base_model
from distft.model.nf4 import NF4Spec, storage_layout
from distft.plan.collective import bytes_by_kind
from distft.plan.hardware import Link
from distft.plan.inputs import PRECISIONS, Parallelism, Training
from distft.plan.memory import state_bytes
from distft.plan.model_spec import resolve_model
from distft.plan.traffic import dp_collectives
from tests.plan import DENSE_MICROS, MICROS
from tests.plan.test_activations import batch

RANK = 5
LINK = Link("test", "a test link", bandwidth=1e9, efficiency=1.0, latency_s=0.0)


def _config(preset: str, method: str):
    return load_config(
        None,
        [
            f"model.name={preset}",
            f"train.method={method}",
            f"lora.rank={RANK}",
            "model.quant_scaler_block_size=4",  # micro's k_proj holds 8 NF4 blocks
        ],
    )


def _planner_name(name: str) -> str:
    """transformers' (and PEFT's) parameter name as the planner writes it: `layers.0.q_proj.bias`.
    peft nests one wrapper per expert stack it adapts: gate_up's inside down's."""
    name = name.removeprefix("base_model.model.").removeprefix("model.")
    name = name.replace("experts.base_layer.lora_", "experts.gate_up_proj.lora_")
    name = name.replace("experts.lora_", "experts.down_proj.lora_").replace("base_layer.", "")
    for part in ("self_attn.", "mlp.", ".default", "_vector"):
        name = name.replace(part, "")
    return name.removesuffix(".weight")


def _parameters(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(_planner_name(n), tuple(p.shape)) for n, p in model.named_parameters()]


@pytest.mark.parametrize("preset", MICROS)
def test_tensor_list_is_the_built_model(preset):
    spec = resolve_model(preset)
    config = PRESETS[preset].to_config()
    torch.manual_seed(0)
    base = load_base_model(_config(preset, "full").model)
    assert _parameters(base) == [(t.name, t.shape) for t in spec.tensors()]
    assert spec.num_params() == sum(p.numel() for p in base.parameters())
    assert spec.family == config.model_type and spec.tie_word_embeddings == config.tie_word_embeddings
    biases = [t.name for t in spec.tensors() if t.kind == "bias"]
    assert len(biases) == (3 * spec.num_layers if preset == "qwen2-micro" else 0)
    assert all(t.tp_dim == 0 for t in spec.tensors() if t.kind == "bias")  # split with q, k, v's rows

    lora = apply_method(base, _config(preset, "lora"))
    adapters = [(n, s) for n, s in _parameters(lora) if ".lora_" in n]
    assert adapters == [(t.name, t.shape) for t in spec.lora_tensors(RANK)]


@pytest.mark.parametrize(
    "preset,method",
    [(p, m) for p in MICROS for m in ("lora", "full", "qlora") if m != "qlora" or p in DENSE_MICROS],
)
def test_state_bytes_are_what_the_built_model_holds(preset, method):
    """One process, one AdamW step: parameters (NF4 inner tensors counted one by one), gradients
    and optimizer state equal the planner's single-layout figures exactly."""
    cfg = _config(preset, method)
    torch.manual_seed(0)
    model = LossLM(apply_method(load_base_model(cfg.model), cfg))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    model(**batch(1, 16, 2)).backward()
    optimizer.step()
    counted = {
        "parameters": sum(storage_layout(model).values()),  # NF4 weights and dense ones
        "gradients": sum(p.grad.untyped_storage().nbytes() for p in trainable),
        "optimizer": sum(
            v.untyped_storage().nbytes()
            for s in optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v)
        ),
    }
    training = Training(
        method=method, precision=PRECISIONS["fp32"], lora_rank=RANK, quant=NF4Spec.from_config(cfg.model)
    )
    want = state_bytes(resolve_model(preset), training, Parallelism("single"))
    assert counted == {"parameters": want.params, "gradients": want.grads, "optimizer": want.optimizer}


def test_fsdp_pads_each_bias_on_its_own():
    """3 FSDP ranks: Qwen2's q/k/v biases (32, 16 and 16 rows) are padded one by one, to 33 and 18
    rows, as FSDP2 pads every parameter: the planner's gathers (twice per micro-batch, ZeRO-3) and
    scatters are the built model's parameters, each padded to a multiple of 3 rows."""
    cfg = _config("qwen2-micro", "full")
    torch.manual_seed(0)
    model = LossLM(apply_method(load_base_model(cfg.model), cfg))
    padded = sum(
        -(-p.shape[0] // 3) * 3 * (p.numel() // p.shape[0]) * p.element_size() for p in model.parameters()
    )
    biases = [p.shape[0] for n, p in model.named_parameters() if n.endswith("_proj.bias")]
    assert set(biases) == {32, 16}  # rows 3 does not divide: each is padded on its own
    training = Training(method="full", precision=PRECISIONS["fp32"], seq_len=32)
    par = Parallelism.at("fsdp", dp=3, microbatches=2)
    spec = resolve_model("qwen2-micro")
    planned = bytes_by_kind(dp_collectives(spec, training, par, LINK, spec.num_layers))
    assert planned == {"all_gather": 2 * 2 * padded, "reduce_scatter": 2 * padded}


# What each released family's plan must say: its parameter count (transformers' own, summed on the
# meta device) and its embeddings.
RELEASED = {
    "meta-llama/Llama-3.1-8B": ("8.03B parameters", "llama family", "(untied embeddings)"),
    "llama3-8b": ("8.03B parameters", "llama family", "(untied embeddings)"),
    "qwen2.5-7b": ("7.62B parameters", "qwen2 family", "q_proj/k_proj/v_proj bias", "(untied embeddings)"),
    "mistral-7b": ("7.25B parameters", "mistral family", "(untied embeddings)"),
    "qwen3-4b": ("4.02B parameters", "qwen3 family", "q/k norm", "(tied embeddings)"),
}


@pytest.mark.parametrize("model", RELEASED)
def test_released_sizes_plan_offline(model, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["plan", "--model", model, "--gpu", "h100", "--gpus", "8", "--method", "full"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for words in RELEASED[model]:
        assert words in out, words
    assert "recommendation:" in out and "distft train --model" in out
    key = next((k for k, p in PRESETS.items() if model in (k, p.hub_id)))
    assert f"--model {PRESETS[key].hub_id}" in out  # the released weights, not a random preset


@pytest.mark.parametrize("preset", ["llama3-8b", "qwen2.5-7b", "mistral-7b", "qwen3-4b"])
def test_parameter_counts_are_transformers_own(preset):
    config = PRESETS[preset].to_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert resolve_model(preset).num_params() == sum(p.numel() for p in model.parameters())
