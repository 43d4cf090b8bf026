"""`distft bench --gpu`: LoRA, QLoRA and full finetuning on one device, against the plain loop.

At the blog series' shapes (Qwen3-4B architecture, LoRA r=16 on every projection, bf16, sequences of
2048 tokens, micro-batch 2, global batch 8) it runs `distft train --strategy single` once per
method and the plain transformers + peft loop (`distft.bench.plain`) on the same rows, each in its
own process (so peak memory and start-up are each run's own), and writes `report.md` and
`results.json`: tokens/s, MFU, peak memory, start-up and first step per run, the ratios
(QLoRA/LoRA, distft/plain) and the performance targets, each marked met or not. Targets are checked
here, in the benchmark, never in a timed test. On CUDA it also writes the run record,
`docs/reports/gpu/<device>/RECORD.md` (`gpu_report.write_record`), to be committed.

Every row is as long as the sequence: the bundled meetings (~500 tokens) are joined end to end
and cut to `--seq-len` by `data.max_length`, so packing and padding do the same work and tokens/s
measures the model, not the data. Without CUDA only the small presets run (the CI test runs
`micro`): a 4B model on a CPU is hours per step.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import psutil
import torch

from distft.bench.harness import BenchSettings, environment, run_strategy
from distft.data.sample import sample_path
from distft.errors import ConfigError
from distft.io.files import atomic_write_text
from distft.model import PRESETS

METHODS = ("lora", "qlora", "full")
# What --gpu runs without a CUDA device: the random test sizes of every family (no released model).
SMALL_MODELS = tuple(name for name, preset in PRESETS.items() if not preset.hub_id)
TARGET_SHAPE = {"model": "qwen3-4b", "seq_len": 2048, "micro_batch_size": 2, "global_batch_size": 8}
GIB = 2**30


@dataclass
class GpuSuiteSettings:
    model: str = "qwen3-4b"
    seq_len: int = 2048
    micro_batch_size: int = 2
    global_batch_size: int = 8
    steps: int = 6
    warmup: int = 2
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    seed: int = 0
    overrides: list[str] = field(default_factory=list)

    def at_target_shape(self) -> bool:
        return all(getattr(self, k) == v for k, v in TARGET_SHAPE.items())

    def argv(self, out: Path) -> list[str]:
        """`distft` arguments that run this suite again, every setting spelled out."""
        return [
            "bench", "--gpu", "--model", self.model, "--seq-len", str(self.seq_len),
            "--micro-batch", str(self.micro_batch_size), "--global-batch", str(self.global_batch_size),
            "--steps", str(self.steps), "--warmup", str(self.warmup), "--methods", ",".join(self.methods),
            "--out", str(out), *self.overrides,
        ]  # fmt: skip


def device_slug(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3': the record's folder name."""
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")


def default_record_dir(device: str) -> Path | None:
    """Where a GPU run's record goes by default; a CPU run (a check of the suite) writes none."""
    return None if device == "cpu" else Path("docs/reports/gpu") / device_slug(device)


def check_device(settings: GpuSuiteSettings, cuda: bool) -> None:
    """Refuse a real-size model without a GPU, before anything runs."""
    bad = [m for m in settings.methods if m not in METHODS]
    if bad:
        raise ConfigError(f"--methods: unknown {', '.join(bad)}; choose from {', '.join(METHODS)}.")
    if not cuda and settings.model not in SMALL_MODELS:
        raise ConfigError(
            f"distft bench --gpu: no CUDA device here, and --model {settings.model} is a full-size model "
            "(a step would take hours on a CPU). Run it on a machine with a GPU, or pass a small preset "
            f"to check the suite itself: --model micro or tiny (or another family's, e.g. llama-micro) with a short --seq-len."
        )


def long_rows(seq_len: int, path: Path, limit: int = 0) -> Path:
    """The bundled training meetings joined end to end, each row long enough to fill `seq_len`
    tokens (about 4 characters a token; 2x margin), written to `path` as JSON lines: one row per
    meeting, or the first `limit` (at long lengths every row holds many meetings: a run that reads
    a few rows need not tokenise hundreds)."""
    rows = [json.loads(line) for line in sample_path("train").read_text().splitlines()]
    chars = sum(len(r["transcript"]) for r in rows) / len(rows)
    join = max(1, math.ceil(seq_len * 8 / chars))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i, row in enumerate(rows[: limit or None]):
            group = [rows[(i + k) % len(rows)]["transcript"] for k in range(join)]
            f.write(json.dumps({"transcript": "\n".join(group), "summary": row["summary"]}) + "\n")
    return path


def _bench_settings(s: GpuSuiteSettings, overrides: list[str]) -> BenchSettings:
    return BenchSettings(
        strategies=["single"], nproc=1, model=s.model, steps=s.steps, warmup=s.warmup,
        global_batch_size=s.global_batch_size, micro_batch_size=s.micro_batch_size, seq_len=s.seq_len,
        seed=s.seed, overrides=overrides,
    )  # fmt: skip


def compile_and_attention(run_dir: Path) -> dict:
    """`compiled_graphs` and `attention` from a run's metrics.jsonl, each the last record's that
    has it (the graph count only grows); None where no record has it (older runs)."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {
        key: next((r[key] for r in reversed(records) if r.get(key) is not None), None)
        for key in ("compiled_graphs", "attention")
    }


def run_distft(s: GpuSuiteSettings, method: str, data: Path, dtype: str, out: Path) -> dict:
    overrides = [f"train.method={method}", f"data.source={data}", f"model.dtype={dtype}", *s.overrides]
    r = run_strategy(_bench_settings(s, overrides), "single", out / "runs" / method)
    return {
        "run": f"distft {method}",
        "method": method,
        "tokens_per_s": r.tokens_per_s["median"],
        "step_time_s": r.step_time_s["median"],
        "mfu": r.extra.get("mfu"),
        "peak_mem_bytes": max(rank["peak_mem_bytes"] for rank in r.ranks),
        "startup_s": r.extra.get("startup_s"),
        "first_step_s": r.extra.get("first_step_s"),
        **compile_and_attention(out / "runs" / method),
        "losses": r.losses,
    }


def run_plain(s: GpuSuiteSettings, data: Path, dtype: str, out: Path) -> dict:
    result = out / "runs" / "plain.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "distft.bench.plain", "--model", s.model, "--data", str(data),
        "--seq-len", str(s.seq_len), "--micro-batch", str(s.micro_batch_size),
        "--global-batch", str(s.global_batch_size), "--steps", str(s.steps), "--warmup", str(s.warmup),
        "--dtype", dtype, "--seed", str(s.seed), "--out", str(result),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    atomic_write_text(out / "runs" / "plain.log", proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"plain loop failed (exit {proc.returncode}): {' | '.join(tail)}")
    plain = json.loads(result.read_text())
    keys = ("tokens_per_s", "step_time_s", "mfu", "peak_mem_bytes", "startup_s", "first_step_s", "losses")
    return {"run": "plain transformers + peft LoRA", "method": "plain", **{k: plain[k] for k in keys}}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(rows: dict[str, dict]) -> dict[str, float | None]:
    """QLoRA/LoRA and distft/plain, from the measured rows (None where a run is missing)."""

    def get(name: str, key: str) -> float | None:
        return rows.get(name, {}).get(key)

    return {
        "qlora_vs_lora_tokens_per_s": _ratio(get("qlora", "tokens_per_s"), get("lora", "tokens_per_s")),
        "distft_vs_plain_tokens_per_s": _ratio(get("lora", "tokens_per_s"), get("plain", "tokens_per_s")),
        "distft_vs_plain_mfu": _ratio(get("lora", "mfu"), get("plain", "mfu")),
        "distft_vs_plain_peak_memory": _ratio(get("lora", "peak_mem_bytes"), get("plain", "peak_mem_bytes")),
        "distft_vs_plain_startup": _ratio(get("lora", "startup_s"), get("plain", "startup_s")),
    }


def targets(rows: dict[str, dict], r: dict, s: GpuSuiteSettings, device: str) -> list[dict]:
    """The performance targets with the measured value; `applies` is false off their setting (the
    absolute figures are for Qwen3-4B at the blog series' shapes on one H100; the ratios for any GPU)."""
    lora = rows.get("lora", {})
    first = None if lora.get("startup_s") is None else lora["startup_s"] + lora["first_step_s"]
    on_h100 = "H100" in device and s.at_target_shape()
    on_gpu = device != "cpu"
    checks = [
        ("LoRA tokens/s >= 22,000", lora.get("tokens_per_s"), 22_000, on_h100),
        ("LoRA MFU >= 40%", lora.get("mfu"), 0.40, on_h100),
        ("distft LoRA >= 2x the plain loop (tokens/s)", r["distft_vs_plain_tokens_per_s"], 2.0, on_gpu),
        ("QLoRA >= 0.8x LoRA (tokens/s)", r["qlora_vs_lora_tokens_per_s"], 0.8, on_gpu),
        ("LoRA first step done within 30 s of the command", first, 30.0, on_h100),
    ]
    out = []
    for name, value, target, applies in checks:
        less_is_better = "within" in name
        met = None if value is None else (value <= target if less_is_better else value >= target)
        out.append({"target": name, "value": value, "threshold": target, "applies": applies, "met": met})
    return out


def suite_environment() -> dict:
    """The bench's environment, plus what the record needs: CUDA, torchao and the device's memory
    (the host's on a CPU). torchao's version is read without importing it (slow, and noisy on a CPU)."""
    try:
        torchao = metadata.version("torchao")
    except metadata.PackageNotFoundError:
        torchao = None
    cuda = torch.cuda.is_available()
    memory = torch.cuda.get_device_properties(0).total_memory if cuda else psutil.virtual_memory().total
    return environment() | {"cuda": torch.version.cuda, "torchao": torchao, "device_memory_bytes": memory}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def run_gpu_suite(s: GpuSuiteSettings, out: Path) -> dict:
    started = _now()
    cuda = torch.cuda.is_available()
    check_device(s, cuda)
    if s.warmup < 1 or s.steps < 1:
        raise ConfigError("--gpu needs --warmup of at least 1 (the first step compiles) and --steps >= 1.")
    out.mkdir(parents=True, exist_ok=True)
    dtype = "bfloat16" if cuda else "float32"
    data = long_rows(s.seq_len, out / "data" / "long.jsonl")
    rows, failures = {}, {}
    for method in [*s.methods, "plain"]:
        print(f"bench --gpu: {method} ...", flush=True)
        try:
            rows[method] = (
                run_plain(s, data, dtype, out)
                if method == "plain"
                else run_distft(s, method, data, dtype, out)
            )
        except RuntimeError as err:
            failures[method] = str(err)
            print(f"bench --gpu: {err}", flush=True)
    env = suite_environment()
    r = ratios(rows)
    summary = {
        "settings": asdict(s), "dtype": dtype, "environment": env, "rows": rows, "ratios": r,
        "targets": targets(rows, r, s, env["device"]), "failures": failures,
        "started_utc": started, "finished_utc": _now(),
    }  # fmt: skip
    atomic_write_text(out / "results.json", json.dumps(summary, indent=1))
    return summary
