"""Model FLOPs per token against a hand count for `micro`, a device name matched to its peak, and
the parts a predicted step time adds up from."""

import pytest
import torch

from distft.config import load_config
from distft.data.chat import IGNORE, Example
from distft.measure.flops import ModelFlops, StepTime, peak_flops
from distft.measure.gpus import gpu_for_device_name
from distft.model import apply_method, load_base_model
from distft.model.presets import MICRO_VOCAB

# micro: hidden 32, MLP 96, 4 layers, 4 heads x head_dim 8 (q/o: 32x32), 2 KV heads (k/v: 32x16).
LAYER = 32 * 32 + 32 * 16 + 32 * 16 + 32 * 32 + 3 * 32 * 96  # q, k, v, o, gate/up/down = 12,288
# LoRA r=16 on all seven: r x (in + out) each.
ADAPTERS = 16 * ((32 + 32) + (32 + 16) + (32 + 16) + (32 + 32) + 2 * (32 + 96) + (96 + 32))  # 9,728
HEAD = 32 * MICRO_VOCAB
LAYERS, ATTN = 4, 4 * 8


def micro(method: str) -> torch.nn.Module:
    cfg = load_config(None, ["model.name=micro", f"train.method={method}", "lora.rank=16"])
    torch.manual_seed(0)
    return apply_method(load_base_model(cfg.model), cfg)


def test_lora_counts_match_the_hand_count():
    flops = ModelFlops.from_model(micro("lora"))
    assert flops == ModelFlops(LAYERS * LAYER, LAYERS * ADAPTERS, HEAD, False, LAYERS, ATTN)
    # A 100-token sequence with 30 labelled tokens: 4N frozen + 6N adapters per token, the (frozen)
    # head on the labelled tokens, and 6 L d_attn s^2 for causal attention.
    want = 100 * (4 * 4 * 12_288 + 6 * 4 * 9_728) + 30 * 4 * 131_072 + 6 * 4 * 32 * 100 * 100
    assert flops.sequence(100, 30) == want == 66_416_640


def test_full_finetuning_is_6n_everywhere():
    flops = ModelFlops.from_model(micro("full"))
    assert (flops.frozen, flops.trainable, flops.head_trains) == (0, LAYERS * LAYER, True)
    assert flops.sequence(10, 10) == 10 * 6 * LAYERS * LAYER + 10 * 6 * HEAD + 6 * LAYERS * ATTN * 100


def test_checkpointing_recomputes_the_layers_forward():
    flops = ModelFlops.from_model(micro("full"))
    assert flops.recompute(10) == 2 * 10 * LAYERS * LAYER + 2 * LAYERS * ATTN * 100
    assert flops.layers_flops(10) + flops.head_flops(4) == flops.sequence(10, 4)


def test_step_time_adds_compute_the_bubble_and_exposed_communication():
    t = StepTime(compute_s=1.0, idle_fraction=0.2, blocking_s=0.1, overlapped_s=1.5, flops=100.0)
    # The bubble is 0.2 of the step: 1.0 x 0.2 / 0.8; of the overlapped 1.5 s, 0.5 outlasts compute.
    assert (t.bubble_s, t.exposed_comm_s) == (pytest.approx(0.25), pytest.approx(0.6))
    assert t.seconds == pytest.approx(1.85)
    # A step of half the FLOPs: compute and its bubble halve, the bytes (and their time) do not.
    assert t.for_flops(50.0) == pytest.approx(0.5 + 0.125 + 0.1 + (1.5 - 0.5))


def test_a_step_sums_its_sequences():
    flops = ModelFlops.from_model(micro("lora"))
    examples = [Example([1] * 100, [IGNORE] * 70 + [5] * 30, 0), Example([1] * 8, [IGNORE] * 7 + [5], 0)]
    assert flops.step(examples) == flops.sequence(100, 30) + flops.sequence(8, 1)


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("NVIDIA L40S", "l40s"),
    ],
)
def test_cuda_device_names_find_their_row(name, key):
    assert gpu_for_device_name(name).name == key


def test_peak_is_none_off_a_known_gpu(monkeypatch):
    peak, why = peak_flops(torch.device("cpu"))
    assert peak is None and "null on cpu" in why
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    peak, what = peak_flops(torch.device("cuda", 0))
    assert peak == 989e12 and "H100" in what
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Tesla T4")
    assert peak_flops(torch.device("cuda", 0))[0] is None
