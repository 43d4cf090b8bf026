"""Run every strategy on the same model, data, global batch and seed, and collect what happened.

Each strategy runs as a real `distft train` (through torchrun for the multi-process ones), so
the benchmark measures exactly what users run. Its figures come from the files every run writes:
`metrics.jsonl` (step times, tokens, losses, bytes per collective on the first step, measured and
analytic) and `ranks.json` (peak memory and saved-activation bytes of every rank).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from distft.bench.pp_sweep import (
    STEP_FIGURES,
    check_split_stages,
    run_name,
    split_override,
    sweep_entry,
    sweep_losses,
)
from distft.bench.predict import parse_profile, plan_memory, project
from distft.bench.reference import time_plain_loop
from distft.errors import ConfigError
from distft.io.files import atomic_write_text
from distft.layout import SPECS
from distft.parallel.pipeline import SCHEDULES
from distft.train.metrics import START_ENV


@dataclass
class BenchSettings:
    strategies: list[str]
    nproc: int = 2
    model: str = "tiny"
    steps: int = 10
    warmup: int = 3
    global_batch_size: int = 8
    micro_batch_size: int = 2
    seq_len: int = 512
    seed: int = 0
    overrides: list[str] = field(default_factory=list)
    pp_schedules: list[str] = field(default_factory=list)  # the pipeline sweep (empty: none)
    pp_microbatches: list[int] = field(default_factory=lambda: [4, 8])
    pp_splits: list[str] = field(default_factory=lambda: ["balanced", "even"])  # `pp_sweep.parse_split`
    project: list[str] = field(default_factory=list)  # hardware profiles, e.g. 2xrtx4090-pcie
    repeats: int = 1  # runs per strategy (or study configuration), interleaved

    def train_args(self, strategy: str, out: Path, extra: tuple[str, ...] = ()) -> list[str]:
        nproc = self.nproc if SPECS[strategy].distributed else 1
        return [
            "train", "--strategy", strategy, "--nproc", str(nproc), "--model", self.model,
            "--max-steps", str(self.warmup + self.steps), "--out", str(out), "--overwrite",
            f"train.global_batch_size={self.global_batch_size}", f"train.micro_batch_size={self.micro_batch_size}",
            f"data.max_length={self.seq_len}", f"train.seed={self.seed}", "train.eval_every=0", "train.log_every=1",
            *self.overrides, *extra,
        ]  # fmt: skip

    def argv(self, out: Path) -> list[str]:
        """`distft` arguments that run this bench again, every setting spelled out."""
        sweep = ["--pp-sweep", ",".join(self.pp_schedules), "--pp-microbatches", ",".join(map(str, self.pp_microbatches)),
                 "--pp-splits", ",".join(self.pp_splits)] if self.pp_schedules else []  # fmt: skip
        return [
            "bench", "--strategies", ",".join(self.strategies), "--nproc", str(self.nproc), "--model", self.model,
            "--steps", str(self.steps), "--warmup", str(self.warmup), "--global-batch", str(self.global_batch_size),
            "--micro-batch", str(self.micro_batch_size), "--seq-len", str(self.seq_len), *sweep,
            *(["--project", ",".join(self.project)] if self.project else []),
            *(["--repeats", str(self.repeats)] if self.repeats != 1 else []), "--out", str(out), *self.overrides,
        ]  # fmt: skip


@dataclass
class StrategyResult:
    strategy: str
    world_size: int
    wall_s: float
    step_time_s: dict[str, float]  # median, min, max over the measured steps
    tokens_per_s: dict[str, float]
    losses: list[float]
    ranks: list[dict]  # per rank: peak_mem_bytes, saved_activation_bytes
    comm_bytes: dict[str, int]
    comm_bytes_expected: dict[str, int]
    comm_calls: dict[str, int] = field(default_factory=dict)
    tokens_per_step: float = 0.0  # median over the measured steps
    extra: dict = field(default_factory=dict)  # strategy-specific figures (e.g. pipeline idle time)
    # With --repeats N > 1: one entry per run (its step time and tokens/s over its measured steps,
    # its overlap figures); step_time_s and tokens_per_s above are then the spread of the runs' medians.
    repeats: list[dict] = field(default_factory=list)


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


OVERLAP_KEYS = ("comm_s", "comm_exposed_s", "overlap_fraction")  # distft.measure.overlap, per step


def combine_repeats(runs: list[StrategyResult]) -> StrategyResult:
    """N runs of one strategy as one result: the first run's deterministic figures (losses, bytes,
    memory), the spread over runs of each run's median step time and tokens/s, the median over runs
    of the overlap figures (their range beside them), and every run's own figures in `repeats`."""
    first = runs[0]
    per_run = [
        {"wall_s": r.wall_s, "step_time_s": r.step_time_s, "tokens_per_s": r.tokens_per_s}
        | {k: r.extra[k] for k in OVERLAP_KEYS if k in r.extra}
        for r in runs
    ]
    if len(runs) == 1:
        return first
    extra = dict(first.extra)
    for key in OVERLAP_KEYS:
        values = [r.extra[key] for r in runs if key in r.extra]
        if values:
            extra[key], extra[f"{key}_range"] = statistics.median(values), [min(values), max(values)]
    losses = [r.losses for r in runs]  # the runs are seeded alike: their losses must agree
    extra["repeat_loss_max_relative_difference"] = max(
        abs(a - b) / abs(b) for curve in losses[1:] for a, b in zip(curve, losses[0], strict=True)
    )
    return replace(
        first,
        step_time_s=_spread([r.step_time_s["median"] for r in runs]),
        tokens_per_s=_spread([r.tokens_per_s["median"] for r in runs]),
        wall_s=statistics.median(r.wall_s for r in runs),
        extra=extra,
        repeats=per_run,
    )


def run_train(argv: list[str], out: Path) -> float:
    """`distft ARGV` (a `train` writing to `out`) in a fresh process, as a user runs it, its output
    in `out`.log; the wall seconds it took. It measures its own start-up, not from the bench
    command's stamp (`START_ENV`)."""
    env = {k: v for k, v in os.environ.items() if k != START_ENV} | {"PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "distft.cli", *argv], capture_output=True, text=True, env=env
    )
    wall = time.perf_counter() - start
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out.parent / f"{out.name}.log", proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{out.name} failed (exit {proc.returncode}): {' | '.join(tail)}")
    return wall


def medians(records: list[dict], keys: tuple[str, ...]) -> dict[str, float]:
    """Each key's median over the records that hold a value for it (none: the key left out)."""
    values = {key: [r[key] for r in records if r.get(key) is not None] for key in keys}
    return {key: statistics.median(v) for key, v in values.items() if v}


def run_strategy(
    settings: BenchSettings, strategy: str, out: Path, extra: tuple[str, ...] = ()
) -> StrategyResult:
    wall = run_train(settings.train_args(strategy, out, extra), out)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    measured = records[settings.warmup :] or records
    first = records[0]
    extra = {k: v for k, v in records[-1].items() if k.startswith("pp_")}
    # the pipeline bubble and stage imbalance: measured, in theory, modelled
    extra |= medians(measured, STEP_FIGURES)
    if "startup_s" in first:  # command start to step 1, and step 1 itself (compilation runs there)
        extra.update(startup_s=first["startup_s"], first_step_s=first["step_time_s"])
    extra |= medians(measured, OVERLAP_KEYS)  # distft.measure.overlap
    if all(r.get("mfu") is not None for r in measured):  # null off a known GPU (distft.measure.flops)
        extra["mfu"] = statistics.median(r["mfu"] for r in measured)
    return StrategyResult(
        strategy=strategy,
        world_size=settings.nproc if SPECS[strategy].distributed else 1,
        wall_s=wall,
        step_time_s=_spread([r["step_time_s"] for r in measured]),
        tokens_per_s=_spread([r["tokens_per_s"] for r in measured]),
        losses=[r["loss"] for r in records],
        ranks=json.loads((out / "ranks.json").read_text()),
        comm_bytes=first.get("comm_bytes", {}),
        comm_bytes_expected=first.get("comm_bytes_expected", {}),
        comm_calls=first.get("comm_calls", {}),
        tokens_per_step=statistics.median(r["tokens"] for r in measured),
        extra=extra,
    )


def run_pp_sweep(settings: BenchSettings, out: Path) -> tuple[list[dict], dict[str, str]]:
    """`pp` once per schedule, micro-batch count and split (`parallel.pp_split`): measured idle
    fraction against theory and the cost model, and the last step's timeline
    (`pipeline_timeline.json`) for the Gantt charts."""
    sweep, failures = [], {}
    for schedule in settings.pp_schedules:
        for m in settings.pp_microbatches:
            for split in settings.pp_splits:
                name = run_name(schedule, m, split)
                print(f"bench: {name} ...", flush=True)
                run_dir = out / "runs" / name
                cell = (f"parallel.schedule={schedule}", f"parallel.microbatches={m}", split_override(split))
                try:
                    r = run_strategy(settings, "pp", run_dir, cell)
                except RuntimeError as err:
                    failures[name] = str(err)
                    print(f"bench: {err}", flush=True)
                    continue
                timeline = json.loads((run_dir / "pipeline_timeline.json").read_text())
                sweep.append(sweep_entry((schedule, m, split), r.step_time_s, r.losses, r.extra, timeline))
    return sweep, failures


def loss_agreement(
    results: list[StrategyResult], rtol: float = 1e-4, others: dict[str, list[float]] | None = None
) -> dict[str, dict]:
    """Every strategy trains the same thing: compare its losses with the first one's, step by step
    (and those of `others`, e.g. the pipeline sweep's runs, by name)."""
    reference = results[0].losses
    curves = {r.strategy: r.losses for r in results} | (others or {})
    report = {}
    for name, losses in curves.items():
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
        report[name] = {"max_relative_difference": worst, "agrees": worst <= rtol}
    return report


def environment() -> dict:
    import peft
    import transformers

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "backend": "nccl" if cuda else "gloo",
    }


def add_predictions(summary: dict, settings: BenchSettings) -> None:
    """The plan's memory prediction for the measured strategies, and the projections (`predict`)."""
    precision = "fp32" if summary["environment"]["device"] == "cpu" else "mixed"
    names = [r["strategy"] for r in summary["results"]]
    labels = int(summary["plain_loop"].get("label_tokens_per_sequence") or 256)
    summary["plan_memory"] = {
        "precision": precision,
        "label_tokens": labels,
        "strategies": plan_memory(settings, names, precision, labels),
    }
    summary["projections"] = [
        project(settings, summary["results"], parse_profile(p)) for p in settings.project
    ]


def run_bench(settings: BenchSettings, out: Path) -> dict:
    unknown = [s for s in settings.strategies if s not in SPECS]
    if unknown:
        raise ConfigError(f"Unknown strategies {', '.join(unknown)}; available: {', '.join(SPECS)}.")
    for profile in settings.project:
        parse_profile(profile)  # fail before running anything
    bad = [s for s in settings.pp_schedules if s not in SCHEDULES]
    if bad:
        raise ConfigError(f"Unknown pipeline schedules {', '.join(bad)}; available: {', '.join(SCHEDULES)}.")
    check_split_stages(settings.pp_splits, settings.pp_schedules, settings.nproc, settings.overrides)
    if settings.warmup < 0 or settings.steps < 1:
        raise ConfigError("--steps must be at least 1 and --warmup cannot be negative.")
    if settings.repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {settings.repeats}.")
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[StrategyResult]] = {}
    failures: dict[str, str] = {}
    for repeat in range(1, settings.repeats + 1):  # interleaved: every strategy once per round
        for strategy in settings.strategies:
            if strategy in failures:
                continue
            of = f" (repeat {repeat}/{settings.repeats})" if settings.repeats > 1 else ""
            print(f"bench: {strategy}{of} ...", flush=True)
            name = strategy if repeat == 1 else f"{strategy}-r{repeat}"
            try:
                runs.setdefault(strategy, []).append(run_strategy(settings, strategy, out / "runs" / name))
            except RuntimeError as err:
                failures[strategy] = str(err)
                runs.pop(strategy, None)  # a strategy that failed once is reported as failed
                print(f"bench: {err}", flush=True)
    results = [combine_repeats(rs) for rs in runs.values()]
    if not results:
        raise ConfigError(f"Every strategy failed: {failures}")
    sweep, sweep_failures = run_pp_sweep(settings, out)
    failures.update(sweep_failures)
    reference = time_plain_loop(settings)
    ours = next((r for r in results if r.strategy == "single"), None)
    summary = {
        "settings": asdict(settings),
        "environment": environment(),
        "results": [asdict(r) for r in results],
        "failures": failures,
        "loss_agreement": loss_agreement(results, others=sweep_losses(sweep)),
        "plain_loop": reference,
        "overhead_ratio": ours.step_time_s["median"] / reference["step_time_s"]["median"] if ours else None,
        "config": (out / "runs" / results[0].strategy / "config.toml").read_text(),
        "pp_sweep": sweep,
    }
    add_predictions(summary, settings)
    atomic_write_text(out / "results.json", json.dumps(summary, indent=1))
    return summary
