"""`distft bench`: every strategy on the same model, data and machine, measured side by side (its
flags: `distft.commands.bench`)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

from distft.bench.experts import ExpertsSettings, print_table, run_experts_bench, write_experts_report
from distft.bench.gpu import GpuSuiteSettings, default_methods, default_record_dir, run_gpu_suite
from distft.bench.gpu_report import write_gpu_report, write_record
from distft.bench.gpu_scaling import default_gpus
from distft.bench.harness import (
    BenchSettings,
    StrategyResult,
    add_predictions,
    loss_agreement,
    run_bench,
)
from distft.bench.pp_sweep import parse_splits, sweep_losses
from distft.bench.report import write_report
from distft.bench.seq_report import write_seq_report
from distft.bench.seq_sweep import SeqSweepSettings, run_seq_sweep
from distft.bench.startup import StartupSettings, run_startup_bench, write_startup_report
from distft.bench.study import run_study
from distft.bench.study_report import write_study_report
from distft.commands.bench import DEFAULT_OUT, DEFAULT_STRATEGIES
from distft.errors import ConfigError
from distft.io.files import MANIFEST, atomic_write_text, write_manifest


def seal(out: Path) -> None:
    """`out/manifest.json` over the report's own files (the markdown, the JSON, the plots): each
    written atomically, and a copy cut short found by `distft.io.files.damage(out)`. The runs
    beside them carry their own manifests."""
    write_manifest(
        out, only=[p for p in out.iterdir() if p.is_file() and p.suffix in (".md", ".json", ".png")]
    )


def _names(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def _listed(text: str, flag: str) -> list[str]:
    """A list the bench cannot run without: an empty one is named (`--strategies ''`)."""
    if names := _names(text):
        return names
    raise ConfigError(
        f"{flag} is empty ({text!r}): name at least one, comma-separated (e.g. {flag} single,ddp)."
    )


def rereport(out: Path, project: list[str]) -> dict:
    """The summary of an earlier run, its predictions and projections recomputed."""
    path = out / "results.json"
    if not path.exists():
        raise ConfigError(f"--report-only: {path} does not exist; run `distft bench --out {out}` first.")
    summary = json.loads(path.read_text())
    settings = BenchSettings(
        **{**summary["settings"], "project": project or summary["settings"].get("project", [])}
    )
    summary["settings"] = asdict(settings)
    add_predictions(summary, settings)
    runs = [StrategyResult(**r) for r in summary["results"]]
    summary["loss_agreement"] = loss_agreement(runs, others=sweep_losses(summary.get("pp_sweep") or []))
    atomic_write_text(path, json.dumps(summary, indent=1))
    return summary


def cmd_gpu(args: argparse.Namespace) -> int:
    settings = GpuSuiteSettings(
        model=args.model or "qwen3-4b",
        seq_len=args.seq_len or 2048,
        micro_batch_size=_given(args.micro_batch, 2),
        global_batch_size=_given(args.global_batch, 8),
        steps=6 if args.steps is None else args.steps,
        warmup=2 if args.warmup is None else args.warmup,
        methods=_names(args.methods) if args.methods else default_methods(),
        gpus=default_gpus() if args.gpus is None else args.gpus,
        overrides=list(args.overrides),
    )
    out = Path(args.out if args.out != DEFAULT_OUT else "runs/bench-gpu")
    summary = run_gpu_suite(settings, out)
    written = [write_gpu_report(summary, out), out / "results.json"]
    record = Path(args.record) if args.record else default_record_dir(summary["environment"]["device"])
    if record:
        spelled_out = shlex.join(["distft", *settings.argv(out)])
        # The command as typed when this process is the distft CLI; a caller of main() has no such line.
        typed = shlex.join(["distft", *sys.argv[1:]]) if sys.argv[1:2] == ["bench"] else spelled_out
        written.append(write_record(summary, record, typed, spelled_out))
    seal(out)
    print(f"\nwrote {', '.join(map(str, written))}\n")
    print(written[0].read_text(), end="")  # last, so that the end of the output holds the figures
    return 1 if summary["failures"] else 0


def cmd_startup(args: argparse.Namespace) -> int:
    try:
        sizes = sorted({int(n) for n in _names(args.rows)})
    except ValueError:
        raise ConfigError(f"--rows takes comma-separated integers, got {args.rows!r}.") from None
    settings = StartupSettings(
        sizes=sizes, nproc=args.nproc, model=args.model or "micro", repeats=args.repeats,
        bound_s=args.startup_bound, overrides=list(args.overrides),
    )  # fmt: skip
    out = Path(args.out if args.out != DEFAULT_OUT else "runs/bench-startup")
    summary = run_startup_bench(settings, out)
    report = write_startup_report(summary, out)
    seal(out)
    print(report.read_text())
    print(f"wrote {report} and {out / 'startup.json'}")
    return 0 if summary["bound"]["holds"] else 1


def cmd_seq_sweep(args: argparse.Namespace) -> int:
    others = [flag for flag, on in (("--seq-len", args.seq_len), ("--report-only", args.report_only),
              ("--study", args.study), ("--pp-sweep", args.pp_sweep), ("--project", args.project)) if on]  # fmt: skip
    if others:
        raise ConfigError(f"--seq-sweep runs its own lengths and nothing else: drop {', '.join(others)}.")
    settings = SeqSweepSettings(
        strategies=_listed(_given(args.strategies, "single,cp" if args.nproc > 1 else "single"), "--strategies"),
        levers=_names(args.seq_levers), nproc=args.nproc, model=args.model or "tiny",
        seq_start=args.seq_start, seq_max=args.seq_max, steps=_given(args.steps, 3), warmup=_given(args.warmup, 1),
        global_batch_size=_given(args.global_batch, 1), micro_batch_size=_given(args.micro_batch, 1),
        overrides=list(args.overrides),
    )  # fmt: skip
    out = Path(args.out if args.out != DEFAULT_OUT else "runs/bench-seq")
    summary = run_seq_sweep(settings, out)
    report = write_seq_report(summary, out)
    seal(out)
    print(report.read_text())
    print(f"wrote {report}, {out / 'results.json'} and {out / 'seq_sweep.png'}")
    return 1 if summary["failures"] else 0


def cmd_experts(args: argparse.Namespace) -> int:
    others = [flag for flag, on in (("--strategies", args.strategies), ("--study", args.study),
              ("--pp-sweep", args.pp_sweep), ("--project", args.project), ("--report-only", args.report_only),
              ("--global-batch", args.global_batch is not None)) if on]  # fmt: skip
    if others:
        raise ConfigError(f"--experts times one model's experts in one process: drop {', '.join(others)}.")
    settings = ExpertsSettings(
        model=args.model or "qwen3-moe-micro", methods=_listed(args.methods or "lora,full", "--methods"),
        micro_batch_size=_given(args.micro_batch, 4), seq_len=args.seq_len or 512,
        steps=_given(args.steps, 5), warmup=_given(args.warmup, 2), overrides=list(args.overrides),
    )  # fmt: skip
    if unknown := [m for m in settings.methods if m not in ("lora", "full")]:
        raise ConfigError(f"--experts --methods takes lora and full, got {', '.join(unknown)}.")
    if settings.steps < 1:
        raise ConfigError(f"--experts needs at least one measured step, got --steps {settings.steps}.")
    out = Path(args.out if args.out != DEFAULT_OUT else "runs/bench-experts")
    summary = run_experts_bench(settings)
    report = write_experts_report(summary, out)
    seal(out)
    print_table(summary)
    print(report.read_text().split("\n\n")[-1], end="")  # the agreement and the target
    print(f"wrote {report} and {out / 'experts.json'}")
    return 0 if summary["agrees"] else 1


def _given(value, default):
    """An option's value, or its default for this mode where it was not given (0 is a value)."""
    return default if value is None else value


def cmd_bench(args: argparse.Namespace) -> int:
    if args.seq_sweep:
        return cmd_seq_sweep(args)
    if args.gpu:
        return cmd_gpu(args)
    if args.startup:
        return cmd_startup(args)
    if args.experts:
        return cmd_experts(args)
    try:
        microbatches = [int(m) for m in _names(args.pp_microbatches)]
    except ValueError:
        raise ConfigError(
            f"--pp-microbatches takes comma-separated integers, got {args.pp_microbatches!r}."
        ) from None
    settings = BenchSettings(
        strategies=_listed(_given(args.strategies, DEFAULT_STRATEGIES), "--strategies"),
        nproc=args.nproc,
        model=args.model or "tiny",
        steps=10 if args.steps is None else args.steps,
        warmup=3 if args.warmup is None else args.warmup,
        global_batch_size=_given(args.global_batch, 8),
        micro_batch_size=_given(args.micro_batch, 2),
        seq_len=args.seq_len or 512,
        overrides=list(args.overrides),
        pp_schedules=_names(args.pp_sweep),
        pp_microbatches=microbatches,
        pp_splits=parse_splits(args.pp_splits),
        project=_names(args.project),
        repeats=args.repeats,
    )
    out = Path(args.out)
    if args.study:
        study = run_study(settings, args.study, out)
        atomic_write_text(out / "study.json", json.dumps(study, indent=1))
        report = write_study_report(study, out)
        seal(out)
        print(report.read_text())
        print(f"\nwrote {report}, {out / 'study.json'} and {out / f'study_{args.study}.png'}")
        return 1 if study["failures"] or not all(a["agrees"] for a in study["loss_agreement"].values()) else 0
    summary = rereport(out, settings.project) if args.report_only else run_bench(settings, out)
    report = write_report(summary, out)
    seal(out)
    print(report.read_text())
    print(f"\nwrote {report}, {out / 'results.json'}, plots and {out / MANIFEST}")
    return 1 if summary["failures"] or not all(a["agrees"] for a in summary["loss_agreement"].values()) else 0
