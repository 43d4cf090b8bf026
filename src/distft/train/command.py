"""`distft train`: the config a run uses, its checks before launch, and the launch.

The flags and the settings they read are `distft.commands.train`'s (light: the CLI reads and
checks them before it imports this module). Here they are completed: `--strategy auto` and the
derived defaults (`distft.plan.complete`), the strategy's checks, and a calibrated pipeline cut;
then `cmd_train` checks the run against the machine and the plan, and trains in this process or
launches the ranks, each of which runs this command again (under torchrun).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

from distft import plan, signals
from distft.commands.train import train_settings
from distft.config import Config, to_toml
from distft.distributed import launched_by_torchrun, wants_cuda
from distft.health import print_network_warnings
from distft.io.lock import run_lock
from distft.io.preflight import check_writable
from distft.launch import launch_ranks, one_thread_before_forking
from distft.layout import SPECS
from distft.layout.rules import layout_left_behind
from distft.parallel import check_config, ignored_settings
from distft.parallel.derive import notes_for_ranks, read_rank_notes
from distft.parallel.pipeline.calibrate import calibrate
from distft.train.hooks import from_environment as hooks_from_environment
from distft.train.loop import train
from distft.train.metrics import stamp_command_start
from distft.train.optim import warmup_warning
from distft.train.preflight import preflight
from distft.train.prepare import resolve_local_paths


def config_from_args(args: argparse.Namespace, settings: Config | None = None) -> Config:
    """The config a run uses. `settings`: `train_settings(args)`, where the caller read them
    already (`distft.cli` does, before it imports this module)."""
    cfg = train_settings(args) if settings is None else settings
    resolve_local_paths(cfg)
    if getattr(args, "resume", None) and not getattr(args, "config", None):  # under another strategy?
        given = {override.partition("=")[0].strip() for override in args.overrides}
        reset = layout_left_behind(cfg, given)  # in every rank alike, said by the launching command
        if reset and not launched_by_torchrun():
            print("\n".join(reset), flush=True)
    if launched_by_torchrun():  # the launching command derived and predicted: its notes
        read_rank_notes(cfg)
    else:  # `--strategy auto` and the defaults that compose with the strategy (`parallel.derive`)
        for line in plan.complete(cfg, say_derived=False):  # the header (or the dry run) says those
            print(line, flush=True)
    check_config(cfg)  # the strategy's checks: before anything is launched
    if getattr(args, "calibrate", None):  # the pipeline's cut from a run's measured stage times
        calibration = calibrate(cfg, args.calibrate, args.overrides)
        calibration.apply(cfg)
        print(calibration.line(), flush=True)
    return cfg


def cmd_train(args: argparse.Namespace, settings: Config | None = None) -> int:
    stamp_command_start()  # a run's start-up counts from this process's start, its imports included
    cfg = config_from_args(args, settings)
    if launched_by_torchrun():  # a rank: the command that launched it checked everything
        return trained(cfg)
    if args.print_config:
        print(to_toml(cfg), end="")
        return 0
    for line in ignored_settings(cfg):  # valid, but does nothing under this strategy
        print(f"distft train: warning: {line}", file=sys.stderr)
    if cfg.train.epochs == 0 and (line := warmup_warning(cfg)):  # epochs: the length is known in the header
        print(f"distft train: warning: {line}", file=sys.stderr)
    check_writable(Path(cfg.output.dir))
    if args.dry_run:  # no lock either: nothing is written to the run directory
        return plan.dry_run(prepared(cfg, args))
    # One writer per run directory, checks included; node 0 takes it for a multi-node run (the
    # others may share its filesystem).
    lock = run_lock(Path(cfg.output.dir)) if cfg.parallel.node_rank == 0 else contextlib.nullcontext()
    with lock:
        distributed, on_cuda = SPECS[cfg.parallel.strategy].distributed, wants_cuda(cfg.train.device)
        if distributed and not on_cuda:  # CPU ranks are forked from this process
            one_thread_before_forking()
        prepared(cfg, args)
        if not distributed:
            return trained(cfg)
        parallel = cfg.parallel
        print_network_warnings(
            "nccl" if on_cuda else "gloo", parallel.nproc, parallel.nnodes, parallel.rdzv_endpoint
        )
        with tempfile.TemporaryDirectory(prefix="distft-launch-") as tmp:
            config_file = os.path.join(tmp, "config.toml")
            with open(config_file, "w", encoding="utf-8") as f:
                f.write(to_toml(cfg))
            # CPU ranks are forked from this process, which has imported distft (`distft.launch`).
            with signals.deferred(), notes_for_ranks(cfg):  # signals: the ranks and the agent act on them
                return launch_ranks(cfg.parallel, ["train", "--config", config_file], fork=not on_cuda)


def prepared(cfg: Config, args: argparse.Namespace) -> Config:
    """What the launching command settles before any rank starts: the machine, every data row and
    the token cache (`preflight`; CUDA asked for and missing is refused there), and the plan's
    prediction, which the ranks record beside what they measure (ranks.json)."""
    cfg.prediction = plan.try_predict(cfg, preflight(cfg, resuming=args.resume is not None))
    _check_fits(cfg, args.force)
    return cfg


def _check_fits(cfg: Config, force: bool) -> None:
    """A run the plan says does not fit is refused before launch (`plan.check_fits`), or with
    --force, said and launched."""
    if warning := plan.check_fits(cfg, force):
        print(f"distft train: warning: {warning}", file=sys.stderr, flush=True)


def trained(cfg: Config) -> int:
    """Train in this process (the run, or one rank of it): 0, or the exit code of the signal that
    stopped it after the line saying where (`distft.signals`)."""
    result = train(cfg, hooks=hooks_from_environment())  # DISTFT_HOOKS (how tests inject faults), else none
    if result.stopped_by is None:
        return 0
    if os.environ.get("RANK", "0") == "0":  # every rank stopped after the same step
        print(result.stopped_line(cfg.train.max_steps), file=sys.stderr, flush=True)
    return signals.exit_code(result.stopped_by)
