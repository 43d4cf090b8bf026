"""`distft doctor`: the pre-flight health check and an all-reduce bandwidth table, and nothing else.

Run it on every node with the same --nproc, --nnodes, --node-rank and --rdzv-endpoint as the job
it vets, before a long multi-node run: in seconds it says whether every rank answers (and names
the ones that do not, with their host), whether one joins late, and what bandwidth the all-reduce
reaches per message size on the backend the job will use (NCCL on GPUs, gloo on CPUs). Like
`distft train`, it launches itself through torchrun, once per rank, after printing the warnings
of `distft.health.network` about this node's environment.

Exit code 0: every rank answered, none late, all on the same device and software; 1: a rank
missing, late or unlike the others (named), or a collective failed; 2: bad arguments. The checks
are `distft.health`'s; docs/multi-node.md shows real output. The flags are `distft.commands.doctor`'s.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
from rich.table import Table

from distft.config import ParallelConfig, load_config
from distft.distributed import (
    DistEnv,
    init_distributed,
    launched_by_torchrun,
    pick_device,
    shutdown,
)
from distft.errors import ConfigError, HealthError
from distft.health import (
    Bandwidth,
    HealthReport,
    check_health,
    measure_all_reduce,
    print_network_warnings,
)
from distft.health.facts import REMEDY
from distft.launch import launch_ranks
from distft.plan.hardware import format_bytes, parse_bytes
from distft.text import console
from distft.train.hooks import from_environment as hooks_from_environment

MAX_ROWS = 32  # ranks listed one by one; a larger job lists its latest-joining ones


def cmd_doctor(args: argparse.Namespace) -> int:
    parallel = _parallel_config(args)
    sizes = _sizes(args.sizes)
    if launched_by_torchrun():
        return run_checks(args, parallel, sizes)
    on_cuda = pick_device(args.device).type == "cuda"
    print_network_warnings(
        "nccl" if on_cuda else "gloo", parallel.nproc, parallel.nnodes, parallel.rdzv_endpoint
    )
    return launch_ranks(parallel, _rank_argv(args), fork=not on_cuda)


def run_checks(args: argparse.Namespace, parallel: ParallelConfig, sizes: list[int]) -> int:
    """In every rank: the health check, the bandwidth per size, and rank 0's tables."""
    env = init_distributed(args.device, parallel.timeout_s, need_group=True)
    hooks = hooks_from_environment()  # DISTFT_HOOKS: how tests make a rank miss the check, or join late
    # HealthError: a rank missing. Mixed ranks are named after the tables, as slow ones are.
    report = check_health(env, replace(parallel, allow_mixed=True), hooks.health if hooks else None)
    bandwidth = measure_all_reduce(env, sizes, args.iterations)
    if env.is_main:
        print_tables(env, report, bandwidth)
    shutdown(env)
    if report.slow or report.mixed:
        error = HealthError(
            " ".join([*report.slow_messages(), *([f"{report.mixed} {REMEDY}"] if report.mixed else [])])
        )
        error.every_rank = False  # every rank saw the same timings; rank 0 reports
        raise error
    return 0


# ---- the tables ---------------------------------------------------------------------------------


def print_tables(env: DistEnv, report: HealthReport, bandwidth: list[Bandwidth]) -> None:
    out = console()
    out.print(report.summary(), soft_wrap=True)
    late = report.late_s
    shown = sorted(sorted(range(len(late)), key=late.__getitem__, reverse=True)[:MAX_ROWS])
    ranks = Table(
        "rank", "node", "host", "local rank", "all-reduce ms", "joined after the first (s)", "status",
        title=f"ranks ({len(shown)} of {len(late)}, the latest to join)" if len(shown) < len(late) else "ranks",
        title_justify="left",
    )  # fmt: skip
    slow = {p.rank for p in report.slow}
    for r in shown:
        p = report.places[r]
        verdict = "[red]slow[/red]" if r in slow else "ok"
        ranks.add_row(
            str(r),
            str(p.node),
            p.host,
            str(p.local_rank),
            f"{1e3 * report.waits_s[r]:.2f}",
            f"{late[r]:.2f}",
            verdict,
        )
    out.print(ranks)
    table = Table(
        "size", "iterations", "time ms", "algbw GB/s", "busbw GB/s",
        title=f"all-reduce, {env.world_size} ranks, {env.backend} on {env.device.type} (slowest rank's mean)",
        title_justify="left",
    )  # fmt: skip
    for b in bandwidth:
        table.add_row(
            format_bytes(b.bytes),
            str(b.iterations),
            f"{1e3 * b.seconds:.3f}",
            f"{b.algbw / 1e9:.3g}",
            f"{b.busbw / 1e9:.3g}",
        )
    out.print(table)
    out.print(
        "busbw = algbw x 2 (n-1) / n: each rank's link rate in a ring all-reduce (nccl-tests' convention)"
    )


# ---- arguments ----------------------------------------------------------------------------------


def _parallel_config(args: argparse.Namespace) -> ParallelConfig:
    """The flags as `parallel.*` settings, checked as `distft train` checks them."""
    cfg = load_config(
        None,
        [
            f"parallel.nproc={args.nproc}",
            f"parallel.nnodes={args.nnodes}",
            f"parallel.node_rank={args.node_rank}",
            f"parallel.rdzv_endpoint={args.rdzv_endpoint}",
            f"parallel.health_timeout_s={args.timeout_s}",
            f"parallel.health_slow_s={args.slow_s}",
        ],
    )
    if args.iterations < 0:
        raise ConfigError(f"--iterations cannot be negative, got {args.iterations}.")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "cuda" and gpus == 0:
        raise ConfigError("--device cuda, but this machine has no CUDA device; use --device cpu or auto.")
    if args.device != "cpu" and gpus and args.nproc > gpus:
        raise ConfigError(
            f"--nproc {args.nproc} asks for more processes than the {gpus} GPU(s) on this node."
        )
    return cfg.parallel


def _sizes(text: str) -> list[int]:
    try:
        sizes = [parse_bytes(s) for s in text.split(",") if s.strip()]
    except ConfigError:
        sizes = []
    if not sizes:
        raise ConfigError(f"--sizes {text!r}: give sizes with a unit, comma-separated: 1KiB,1MiB,64MiB.")
    return sizes


def _rank_argv(args: argparse.Namespace) -> list[str]:
    """The command each rank runs: this one, less the layout flags torchrun has taken (its own
    parser would refuse `--nproc`, an abbreviation of two of its options, even after `-m distft.cli`)."""
    flags = {
        "--device": args.device,
        "--sizes": args.sizes,
        "--iterations": args.iterations,
        "--timeout-s": args.timeout_s,
        "--slow-s": args.slow_s,
    }
    return ["doctor", *(item for flag, value in flags.items() for item in (flag, str(value)))]
