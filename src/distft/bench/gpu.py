"""`distft bench --gpu`: LoRA, QLoRA and full finetuning on one device, against the plain loop.

At the blog series' shapes (Qwen3-4B architecture, LoRA r=16 on every projection, bf16, sequences of
2048 tokens, micro-batch 2, global batch 8) it runs `distft train --strategy single` once per
method and the plain transformers + peft loop (`distft.bench.plain`) on the same rows, each in its
own process (so peak memory and start-up are each run's own), and writes `report.md` and
`results.json`: tokens/s, MFU, peak memory, start-up and first step per run, the ratios
(QLoRA/LoRA, distft/plain) and the performance targets, each marked met or not. Targets are checked
here, in the benchmark, never in a timed test. On CUDA it also writes the run record,
`docs/reports/gpu/<device>/RECORD.md` (`gpu_report.write_record`), to be committed.

Beside the speed rows, each at its own settings: distft's LoRA again at the plain loop's learning
rate and schedule, from the same weights, its loss curve against the plain loop's
(`distft.bench.parity`), and step 1 cold and warm: every distft run compiles into the suite's own
`DIR/compile-cache`, emptied first, so the LoRA row compiles from nothing and the parity row, the
same graph, finds every kernel built.

Every row is as long as the sequence: the bundled meetings (~500 tokens) are joined end to end
and cut to `--seq-len` by `data.max_length`, so packing and padding do the same work and tokens/s
measures the model, not the data. Without CUDA only the small presets run (the CI test runs
`micro`): a 4B model on a CPU is hours per step.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import psutil
import torch

from distft.bench.gpu_scaling import SCALING_STRATEGIES, check_gpus, scaling_global_batch, scaling_row
from distft.bench.harness import BenchSettings, environment, run_strategy
from distft.bench.parity import PLAIN_LR, compare, plain_settings
from distft.data.sample import sample_path
from distft.errors import ConfigError
from distft.io.files import atomic_write_text
from distft.model import PRESETS
from distft.model.fp8 import FP8_CAPABILITY

METHODS = ("lora", "qlora", "full", "lora-fp8")
# What each distft row trains, as `distft train` overrides.
METHOD_OVERRIDES = {
    "lora": ["train.method=lora"],
    "qlora": ["train.method=qlora"],
    "full": ["train.method=full"],
    "lora-fp8": ["train.method=lora", "model.fp8=base"],  # float8 matmuls for the frozen base
}
# What --gpu runs without a CUDA device: the random test sizes of every family (no released model).
SMALL_MODELS = tuple(name for name, preset in PRESETS.items() if not preset.hub_id)
TARGET_SHAPE = {"model": "qwen3-4b", "seq_len": 2048, "micro_batch_size": 2, "global_batch_size": 8}
# NeMo AutoModel's published single-GPU LoRA figure: Qwen2.5-7B, seq 4096, micro-batch 2, one H100,
# 14,110 tokens/s at 42.8% MFU (counted as distft counts LoRA's FLOPs: 4N + attention).
ANCHOR_SHAPE = {"model": "qwen2.5-7b", "seq_len": 4096, "micro_batch_size": 2}
ANCHOR_TOKENS_PER_S, ANCHOR_MFU = 14_110, 0.428
GIB = 2**30


@dataclass
class GpuSuiteSettings:
    model: str = "qwen3-4b"
    seq_len: int = 2048
    micro_batch_size: int = 2
    global_batch_size: int = 8
    steps: int = 6
    warmup: int = 2
    methods: list[str] = field(default_factory=lambda: list(METHODS[:3]))
    seed: int = 0
    gpus: int = 1  # > 1: LoRA under ddp and fsdp on that many devices too (`distft.bench.gpu_scaling`)
    overrides: list[str] = field(default_factory=list)

    def at_target_shape(self) -> bool:
        return all(getattr(self, k) == v for k, v in TARGET_SHAPE.items())

    def at_anchor_shape(self) -> bool:
        return all(getattr(self, k) == v for k, v in ANCHOR_SHAPE.items())

    def argv(self, out: Path) -> list[str]:
        """`distft` arguments that run this suite again, every setting spelled out."""
        return [
            "bench", "--gpu", "--model", self.model, "--seq-len", str(self.seq_len),
            "--micro-batch", str(self.micro_batch_size), "--global-batch", str(self.global_batch_size),
            "--steps", str(self.steps), "--warmup", str(self.warmup), "--methods", ",".join(self.methods),
            "--gpus", str(self.gpus), "--out", str(out), *self.overrides,
        ]  # fmt: skip


def default_methods() -> list[str]:
    """Every method this machine runs: FP8 only on a GPU with float8 tensor cores."""
    fp8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= FP8_CAPABILITY
    return [m for m in METHODS if fp8 or m != "lora-fp8"]


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
    check_gpus(settings.gpus, cuda)
    if "lora-fp8" in settings.methods and "lora-fp8" not in default_methods():
        raise ConfigError(
            "--methods lora-fp8: float8 matmuls need a CUDA GPU of compute capability 8.9 or newer "
            "(H100, H200, L40S, RTX 4090); drop lora-fp8 from --methods here."
        )
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


def _bench_settings(s: GpuSuiteSettings, overrides: list[str], gpus: int = 1) -> BenchSettings:
    return BenchSettings(
        strategies=["single"], nproc=gpus, model=s.model, steps=s.steps, warmup=s.warmup,
        global_batch_size=scaling_global_batch(s.global_batch_size, s.micro_batch_size, gpus),
        micro_batch_size=s.micro_batch_size, seq_len=s.seq_len, seed=s.seed, overrides=overrides,
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


def _overrides(s: GpuSuiteSettings, method: str, data: Path, dtype: str, out: Path, extra=()) -> list[str]:
    """A distft row's `distft train` overrides: `method`'s, the suite's rows, dtype and compile
    cache, the user's overrides, then `extra` (the parity row's optimizer settings)."""
    return [
        *METHOD_OVERRIDES[method], f"data.source={data}", f"model.dtype={dtype}",
        f"model.compile_cache={out / 'compile-cache'}", *s.overrides, *extra,
    ]  # fmt: skip


def run_distft(
    s: GpuSuiteSettings, method: str, data: Path, dtype: str, out: Path, name: str = "", extra: tuple = ()
) -> dict:
    """One `distft train --strategy single` row."""
    name = name or method
    overrides = _overrides(s, method, data, dtype, out, extra)
    r = run_strategy(_bench_settings(s, overrides), "single", out / "runs" / name)
    return {
        "run": f"distft {name}",
        "method": method,
        "tokens_per_s": r.tokens_per_s["median"],
        "step_time_s": r.step_time_s["median"],
        "mfu": r.extra.get("mfu"),
        "peak_mem_bytes": max(rank["peak_mem_bytes"] for rank in r.ranks),
        "startup_s": r.extra.get("startup_s"),
        "first_step_s": r.extra.get("first_step_s"),
        **compile_and_attention(out / "runs" / name),
        "losses": r.losses,
    }


def run_plain(s: GpuSuiteSettings, data: Path, dtype: str, out: Path) -> dict:
    result = out / "runs" / "plain.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "distft.bench.plain", "--model", s.model, "--data", str(data),
        "--seq-len", str(s.seq_len), "--micro-batch", str(s.micro_batch_size),
        "--global-batch", str(s.global_batch_size), "--steps", str(s.steps), "--warmup", str(s.warmup),
        "--dtype", dtype, "--seed", str(s.seed), "--lr", f"{PLAIN_LR:g}", "--out", str(result),
    ]  # fmt: skip
    cmd += [f"--set={o}" for o in s.overrides if o.startswith("data.")]  # the same rows as distft's
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
    """QLoRA/LoRA, FP8/LoRA and distft/plain, from the measured rows (None where a run is missing)."""

    def get(name: str, key: str) -> float | None:
        return rows.get(name, {}).get(key)

    return {
        "qlora_vs_lora_tokens_per_s": _ratio(get("qlora", "tokens_per_s"), get("lora", "tokens_per_s")),
        "fp8_vs_lora_tokens_per_s": _ratio(get("lora-fp8", "tokens_per_s"), get("lora", "tokens_per_s")),
        "distft_vs_plain_tokens_per_s": _ratio(get("lora", "tokens_per_s"), get("plain", "tokens_per_s")),
        "distft_vs_plain_mfu": _ratio(get("lora", "mfu"), get("plain", "mfu")),
        "distft_vs_plain_peak_memory": _ratio(get("lora", "peak_mem_bytes"), get("plain", "peak_mem_bytes")),
        "distft_vs_plain_startup": _ratio(get("lora", "startup_s"), get("plain", "startup_s")),
    }


def to_step_one(row: dict) -> float | None:
    """Seconds from the command to the end of step 1: start-up, then the step that compiles."""
    return None if row.get("startup_s") is None else row["startup_s"] + row["first_step_s"]


def targets(
    rows: dict[str, dict], r: dict, s: GpuSuiteSettings, device: str, parity: dict | None = None
) -> list[dict]:
    """The performance targets with the measured value; `applies` is false off their setting (the
    absolute figures are for Qwen3-4B at the blog series' shapes on one H100 or H200, NeMo
    AutoModel's at its own shape; the ratios and the loss parity hold on any GPU)."""
    lora, full = rows.get("lora", {}), rows.get("full", {})
    hopper = "H100" in device or "H200" in device
    at_shape, on_gpu = hopper and s.at_target_shape(), device != "cpu"
    worst = parity and parity["max_relative_difference"]
    checks = [  # (target, value, threshold, applies, unit; "s" and "relative": less is better)
        ("LoRA MFU >= 44%", lora.get("mfu"), 0.44, at_shape, "%"),
        ("full MFU >= 45%", full.get("mfu"), 0.45, at_shape, "%"),
        ("FP8-base LoRA >= 1.3x bf16 LoRA (tokens/s)", r["fp8_vs_lora_tokens_per_s"], 1.3, on_gpu, "x"),
        ("QLoRA >= 0.95x LoRA (tokens/s)", r["qlora_vs_lora_tokens_per_s"], 0.95, on_gpu, "x"),
        ("distft LoRA >= 2x the plain loop (tokens/s)", r["distft_vs_plain_tokens_per_s"], 2.0, on_gpu, "x"),
        ("LoRA step 1 within 60 s of the command, compile cache cold", to_step_one(lora), 60.0, at_shape, "s"),
        ("LoRA step 1 within 30 s of the command, compile cache warm",
         to_step_one(rows.get("lora-parity", {})), 30.0, at_shape, "s"),
        ("loss per step within the tolerance of the plain loop's (largest relative difference)",
         worst, parity and parity["tolerance"], True, "relative"),
    ]  # fmt: skip
    if s.at_anchor_shape():  # like for like with NeMo AutoModel's published figure
        anchor = hopper and s.at_anchor_shape()
        checks += [
            (f"at NeMo AutoModel's shape, LoRA tokens/s >= {ANCHOR_TOKENS_PER_S:,}",
             lora.get("tokens_per_s"), ANCHOR_TOKENS_PER_S, anchor, "tokens/s"),
            (f"at NeMo AutoModel's shape, LoRA MFU >= {ANCHOR_MFU:.1%}", lora.get("mfu"), ANCHOR_MFU, anchor, "%"),
        ]  # fmt: skip
    out = []
    for name, value, target, applies, unit in checks:
        less_is_better = unit in ("s", "relative")
        met = None if value is None else (value <= target if less_is_better else value >= target)
        out.append(
            {
                "target": name,
                "value": value,
                "threshold": target,
                "applies": applies,
                "met": met,
                "unit": unit,
            }
        )
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
    shutil.rmtree(out / "compile-cache", ignore_errors=True)  # the first compiling row starts cold
    dtype = "bfloat16" if cuda else "float32"
    data = long_rows(s.seq_len, out / "data" / "long.jsonl")
    rows, failures = {}, {}
    runs = {m: (lambda m=m: run_distft(s, m, data, dtype, out)) for m in s.methods}
    runs["plain"] = lambda: run_plain(s, data, dtype, out)
    # distft's LoRA at the plain loop's settings: the loss parity, and step 1 with the cache warm.
    runs["lora-parity"] = lambda: run_distft(
        s, "lora", data, dtype, out, "lora-parity", plain_settings(s.seed)
    )
    for name, run in runs.items():
        print(f"bench --gpu: {name} ...", flush=True)
        try:
            rows[name] = run()
        except RuntimeError as err:
            failures[name] = str(err)
            print(f"bench --gpu: {err}", flush=True)
    scaling = {}
    for strategy in SCALING_STRATEGIES if s.gpus > 1 else ():
        print(f"bench --gpu: lora under {strategy} on {s.gpus} devices ...", flush=True)
        settings = _bench_settings(s, _overrides(s, "lora", data, dtype, out), s.gpus)
        try:
            result = run_strategy(settings, strategy, out / "runs" / f"{strategy}-x{s.gpus}")
            scaling[strategy] = scaling_row(result, strategy, s.gpus, rows.get("lora"))
        except RuntimeError as err:
            failures[f"{strategy} x {s.gpus}"] = str(err)
    parity = None
    if "plain" in rows and "lora-parity" in rows:
        parity = compare(rows["lora-parity"]["losses"], rows["plain"]["losses"], dtype)
    env = suite_environment()
    r = ratios(rows)
    summary = {
        "settings": asdict(s), "dtype": dtype, "environment": env, "rows": rows, "ratios": r,
        "parity": parity, "scaling": scaling, "targets": targets(rows, r, s, env["device"], parity), "failures": failures,
        "started_utc": started, "finished_utc": _now(),
    }  # fmt: skip
    atomic_write_text(out / "results.json", json.dumps(summary, indent=1))
    return summary
