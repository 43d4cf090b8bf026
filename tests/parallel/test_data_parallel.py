"""DDP, FSDP (ZeRO-3) and ZeRO-2 on 2 gloo processes train exactly like one process.

Each test launches `distft train --nproc 2` for real (torchrun, gloo, CPU) and compares the
per-step losses and the exported adapter with the single-process reference on the same global
batch, then checks the bytes every collective moved against the analytic volume.
"""

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from distft.cli import main
from distft.config import load_config
from distft.infer import load_trained
from distft.model import apply_method, load_base_model
from tests.helpers import PARITY, adapter, assert_same_training, crashed_copy, distft, metrics

WORLD = 2
ACCUMULATION = 2  # global batch 4 = micro 1 x 2 x 2 ranks


@pytest.fixture(scope="module")
def micro_lora():
    cfg = load_config(None, ["model.name=micro"])
    torch.manual_seed(0)
    return apply_method(load_base_model(cfg.model), cfg)


def padded_bytes(p: torch.Tensor, n: int) -> int:
    return -(-p.shape[0] // n) * n * (p.numel() // p.shape[0]) * p.element_size()


def expected_bytes(strategy: str, model) -> dict[str, int]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    if strategy == "ddp":  # trainable gradients once per step, plus the loss scalar
        return {"all_reduce": sum(p.numel() * 4 for p in trainable) + 4}
    gathers = 2 if strategy == "fsdp" else 1  # ZeRO-3 gathers again in backward
    return {
        "all_gather": ACCUMULATION * gathers * sum(padded_bytes(p, WORLD) for p in model.parameters()),
        "reduce_scatter": ACCUMULATION * sum(padded_bytes(p, WORLD) for p in trainable),
        "all_reduce": 4 + 8,  # the loss, and the gradient norm's float64 sum of squares
    }


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2"])
def test_matches_single_process(strategy, reference, micro_lora, tmp_path):
    out = tmp_path / strategy
    proc = distft("train", "--strategy", strategy, "--nproc", str(WORLD), *PARITY, "--out", str(out))
    assert "global batch 4 = micro-batch 1 x accumulation 2 x data-parallel ranks 2" in proc.stdout
    assert_same_training(out, reference)

    first = metrics(out)[0]
    expected = expected_bytes(strategy, micro_lora)
    assert first["comm_bytes"] == expected
    assert first["comm_bytes_expected"] == expected


def test_adapters_load_anywhere_with_the_same_logits(reference, tmp_path):
    out = tmp_path / "fsdp"
    distft("train", "--strategy", "fsdp", "--nproc", str(WORLD), *PARITY, "--out", str(out))
    ids = torch.randint(0, 4000, (2, 20))
    logits = []
    for run in (reference, out):
        base = AutoModelForCausalLM.from_pretrained(run / "base")
        model = PeftModel.from_pretrained(base, run / "adapter").eval()
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)  # logits are O(10)


def test_fsdp_checkpoint_resumes_at_another_world_size(reference, tmp_path):
    """DCP reshards: a ZeRO-3 checkpoint written by 2 ranks resumes in 1 process, same training."""
    out = tmp_path / "resharded"
    distft(
        "train", "--strategy", "fsdp", "--nproc", "2", *PARITY, "--checkpoint-every", "2", "--out", str(out)
    )
    assert (out / "checkpoints" / "step-000002").is_dir()
    out = crashed_copy(out, tmp_path / "crashed", 2)
    proc = distft("train", "--resume", str(out), "--nproc", "1")
    assert "resuming from" in proc.stdout and "step 2" in proc.stdout
    assert_same_training(out, reference)


def test_ddp_static_graph(reference, tmp_path, capsys):
    static = ["--strategy", "ddp", "--nproc", "2", *PARITY, "parallel.ddp_static_graph=true"]
    # With accumulation, DDP's reducer would fail mid-run: refused before launch instead.
    assert main(["train", *static, "--out", str(tmp_path / "refused")]) == 2
    assert "cannot be combined with gradient accumulation" in capsys.readouterr().err
    out = tmp_path / "static"
    distft("train", *static, "train.micro_batch_size=2", "--out", str(out))  # no accumulation
    assert_same_training(out, reference)


# ---- the misconfiguration switches: the same training, only the traffic changes -------


def test_ddp_without_no_sync_moves_accumulation_times_the_bytes(reference, micro_lora, tmp_path):
    out = tmp_path / "every-micro-batch"
    distft(
        "train", "--strategy", "ddp", "--nproc", "2", *PARITY, "parallel.ddp_no_sync=false", "--out", str(out)
    )
    assert_same_training(out, reference)
    first = metrics(out)[0]
    grads = expected_bytes("ddp", micro_lora)["all_reduce"] - 4
    assert first["comm_bytes"]["all_reduce"] == ACCUMULATION * grads + 4
    assert first["comm_calls"]["all_reduce"] == ACCUMULATION + 1  # one bucket per micro-batch, the loss
    assert first["comm_bytes"] == first["comm_bytes_expected"]  # incl. the bucket rebuild's broadcast


def test_ddp_misconfigurations_change_only_the_traffic(reference, micro_lora, tmp_path):
    out = tmp_path / "misconfigured"
    switches = [
        "parallel.ddp_find_unused_parameters=true",
        "parallel.ddp_broadcast_buffers=true",
        "parallel.ddp_bucket_mb=0.01",
    ]
    distft("train", "--strategy", "ddp", "--nproc", "2", *PARITY, *switches, "--out", str(out))
    assert_same_training(out, reference)
    first = metrics(out)[0]
    trainable = [p for p in micro_lora.parameters() if p.requires_grad]
    buffers = sum(b.numel() * b.element_size() for b in micro_lora.buffers())
    # The used-parameter bitmap (int32 per trainable tensor) and the rotary tables once per step.
    assert first["comm_bytes"] == {
        "all_reduce": expected_bytes("ddp", micro_lora)["all_reduce"] + 4 * len(trainable),
        "broadcast": buffers,
    }
    assert first["comm_bytes"] == first["comm_bytes_expected"]
    # Without a bucket rebuild (find_unused), 0.01 MB buckets hold one or a few tensors each.
    assert first["comm_calls"]["all_reduce"] > 10


def test_fsdp_whole_model_unit_without_prefetch(reference, micro_lora, tmp_path):
    out = tmp_path / "fsdp-model"
    switches = ["parallel.fsdp_wrap=model", "parallel.fsdp_prefetch=0"]
    distft("train", "--strategy", "fsdp", "--nproc", "2", *PARITY, *switches, "--out", str(out))
    assert_same_training(out, reference)
    first = metrics(out)[0]
    assert first["comm_bytes"] == first["comm_bytes_expected"] == expected_bytes("fsdp", micro_lora)
    # The same bytes in one gather per pass: forward and backward of each micro-batch.
    assert first["comm_calls"]["all_gather"] == 2 * ACCUMULATION


# ---- LoRA variants: DoRA's magnitudes and LoRA+'s second param group, sharded and replicated ------

VARIANT = ["lora.variant=dora", "lora.lr_ratio=4", "train.max_steps=2"]


@pytest.fixture(scope="module")
def variant_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("dora-single")
    distft("train", *PARITY, *VARIANT, "--out", str(out))
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_dora_with_lora_plus_matches_single_process(strategy, variant_reference, tmp_path):
    out = tmp_path / strategy
    proc = distft(
        "train", "--strategy", strategy, "--nproc", str(WORLD), *PARITY, *VARIANT, "--out", str(out)
    )
    assert "adapters: dora, rank 16" in proc.stdout and "LoRA+: lora_B at lr x 4" in proc.stdout
    assert_same_training(out, variant_reference)  # every lora_A, lora_B and magnitude vector
    assert any("lora_magnitude_vector" in name for name in adapter(out))
    if strategy == "fsdp":  # a standard PEFT adapter: peft and `distft infer` load it, same logits
        ids = torch.randint(0, 4000, (1, 16))
        base = AutoModelForCausalLM.from_pretrained(variant_reference / "base")
        peft = PeftModel.from_pretrained(base, variant_reference / "adapter").eval()
        loaded = load_trained(run=str(out)).model.eval()
        with torch.no_grad():
            torch.testing.assert_close(
                loaded(input_ids=ids).logits, peft(input_ids=ids).logits, rtol=1e-5, atol=1e-5
            )
