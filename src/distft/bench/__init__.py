"""`distft bench`: every strategy on the same model, data and machine, measured side by side."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

from distft.bench.gpu import GpuSuiteSettings, default_record_dir, run_gpu_suite
from distft.bench.gpu_report import write_gpu_report, write_record
from distft.bench.harness import (
    BenchSettings,
    StrategyResult,
    add_predictions,
    loss_agreement,
    run_bench,
)
from distft.bench.pp_sweep import DEFAULT_SPLITS, parse_splits, sweep_losses
from distft.bench.report import write_report
from distft.bench.seq_report import write_seq_report
from distft.bench.seq_sweep import DEFAULT_LEVERS, SeqSweepSettings, run_seq_sweep
from distft.bench.startup import StartupSettings, run_startup_bench, write_startup_report
from distft.bench.study import STUDIES, run_study
from distft.bench.study_report import write_study_report
from distft.errors import ConfigError
from distft.io.files import MANIFEST, atomic_write_text, write_manifest

DEFAULT_STRATEGIES = "single,ddp,fsdp,zero2,tp,tp-sp,pp"  # every strategy that runs on 2 processes
PP_SCHEDULES = "gpipe,1f1b,interleaved-1f1b,zero-bubble,zbv"
DEFAULT_OUT = "runs/bench"


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run strategies side by side and write a report with plots",
        description="Run each strategy with the same model, data, global batch, sequence length and seed; "
        "collect step time, tokens/s, peak memory per rank, bytes per collective (measured and analytic) "
        "and loss curves; write DIR/results.json, DIR/report.md and PNG plots.",
    )
    p.add_argument(
        "--strategies",
        help=f"comma-separated (default {DEFAULT_STRATEGIES}; --seq-sweep: single, and cp when --nproc > 1)",
    )
    p.add_argument("--nproc", type=int, default=2, help="processes for the multi-process strategies")
    p.add_argument(
        "--model", help="preset, local directory or hub id (default tiny; --gpu: qwen3-4b; --startup: micro)"
    )
    p.add_argument("--steps", type=int, help="measured optimizer steps per run (default 10; --gpu: 6)")
    p.add_argument("--warmup", type=int, help="steps run before measuring (default 3; --gpu: 2)")
    p.add_argument(
        "--global-batch", type=int, help="sequences per optimizer step (default 8; --seq-sweep: 1)"
    )
    p.add_argument(
        "--micro-batch", type=int, help="sequences per forward/backward on a rank (default 2; --seq-sweep: 1)"
    )
    p.add_argument("--seq-len", type=int, help="data.max_length (default 512; --gpu: 2048)")
    p.add_argument(
        "--gpu",
        action="store_true",
        help="the one-device suite instead: distft single LoRA, QLoRA and full finetuning and the plain "
        "transformers+peft loop at the blog series' shapes (qwen3-4b, seq 2048, micro-batch 2, global 8, bf16); "
        "tokens/s, MFU, peak memory, start-up, the ratios and the targets (docs/bench.md)",
    )
    p.add_argument("--methods", default="lora,qlora,full", help="--gpu: the distft methods to run")
    p.add_argument(
        "--record",
        metavar="DIR",
        help="--gpu: write the run record DIR/RECORD.md (date, command, versions, device, every figure); "
        "default on CUDA docs/reports/gpu/DEVICE, none on the CPU",
    )
    _add_pp_sweep_arguments(p)
    p.add_argument(
        "--project",
        default="",
        metavar="PROFILES",
        help="project the measured compute and bytes onto hardware profiles, e.g. 2xrtx4090-pcie,8xh100-nvlink "
        "(N x a `distft plan` GPU, optionally -pcie/-nvlink/...), and say which strategy should win there",
    )
    p.add_argument(
        "--study",
        choices=sorted(STUDIES),
        help="run a correct configuration beside its misconfigurations (ddp-misconfig, fsdp-wrap) instead of "
        "--strategies; writes DIR/study.md and DIR/study_NAME.png",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per strategy (or --study configuration), interleaved; the report gives each one's median "
        "and min-max over the runs and names a winner only where the ranges do not overlap (default 1)",
    )
    _add_startup_arguments(p)
    _add_seq_sweep_arguments(p)
    p.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help="output directory (default runs/bench; --gpu: runs/bench-gpu; --startup: runs/bench-startup; "
        "--seq-sweep: runs/bench-seq)",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: rewrite DIR/report.md, the plots and the projections from DIR/results.json "
        "(with this command's --project profiles)",
    )
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="passed to every `distft train`")


def _add_pp_sweep_arguments(p: argparse.ArgumentParser) -> None:
    """`distft bench --pp-sweep`: pp per schedule, micro-batch count and cut (`bench.pp_sweep`)."""
    p.add_argument(
        "--pp-sweep",
        nargs="?",
        const=PP_SCHEDULES,
        default="",
        metavar="SCHEDULES",
        help=f"also run pp for each schedule (default with no value: {PP_SCHEDULES}), each --pp-microbatches "
        "and each --pp-splits: idle fraction vs micro-batches, measured against the cost model and theory, "
        "and a Gantt chart per schedule and split",
    )
    p.add_argument(
        "--pp-microbatches", default="4,8", help="micro-batch counts of the pipeline sweep (default 4,8)"
    )
    p.add_argument(
        "--pp-splits",
        default=DEFAULT_SPLITS,
        metavar="SPLITS",
        help=f"cuts of the layers the pipeline sweep runs (parallel.pp_split; default {DEFAULT_SPLITS}): "
        "balanced, even, or layers per stage joined by '-', e.g. 3-1",
    )


def _add_startup_arguments(p: argparse.ArgumentParser) -> None:
    """`distft bench --startup`: start-up time against the dataset's size (`bench.startup`)."""
    p.add_argument(
        "--startup",
        action="store_true",
        help="time from the command to step 1 against the dataset's size (--rows), token cache off, cold and "
        "warm, on --nproc ranks of ddp; writes DIR/startup.md and fails if a warm start-up exceeds the smallest "
        "size's by more than --startup-bound seconds (docs/data.md)",
    )
    p.add_argument(
        "--rows", default="1000,10000,100000", help="--startup: dataset sizes (default 1000,10000,100000)"
    )
    p.add_argument(
        "--startup-bound", type=float, default=5.0, help="--startup: the bound in seconds (default 5)"
    )


def _add_seq_sweep_arguments(p: argparse.ArgumentParser) -> None:
    """`distft bench --seq-sweep`: doubling sequence lengths per strategy and lever (`bench.seq_sweep`)."""
    p.add_argument(
        "--seq-sweep",
        action="store_true",
        help="instead of one length: each strategy x lever at doubling data.max_length from --seq-start to "
        "--seq-max or until a run runs out of memory; tokens/s, MFU, peak memory and activations (measured and "
        "planned) per length; writes DIR/report.md, DIR/results.json and DIR/seq_sweep.png",
    )
    p.add_argument("--seq-start", type=int, default=1024, help="--seq-sweep: the first length (default 1024)")
    p.add_argument(
        "--seq-max", type=int, default=0, help="--seq-sweep: the last length (default: the model's positions)"
    )
    p.add_argument(
        "--seq-levers",
        default=DEFAULT_LEVERS,
        help=f"--seq-sweep: model.activation_checkpointing levels, each optionally +tilesK for model.mlp_tiles=K "
        f"(default {DEFAULT_LEVERS}; offload is skipped on the CPU, where it is full)",
    )


def seal(out: Path) -> None:
    """`out/manifest.json` over the report's own files (the markdown, the JSON, the plots): each
    written atomically, and a copy cut short found by `distft.io.files.damage(out)`. The runs
    beside them carry their own manifests."""
    write_manifest(
        out, only=[p for p in out.iterdir() if p.is_file() and p.suffix in (".md", ".json", ".png")]
    )


def _names(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


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
        methods=_names(args.methods),
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
        strategies=_names(_given(args.strategies, "single,cp" if args.nproc > 1 else "single")),
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
    try:
        microbatches = [int(m) for m in _names(args.pp_microbatches)]
    except ValueError:
        raise ConfigError(
            f"--pp-microbatches takes comma-separated integers, got {args.pp_microbatches!r}."
        ) from None
    settings = BenchSettings(
        strategies=_names(_given(args.strategies, DEFAULT_STRATEGIES)),
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
