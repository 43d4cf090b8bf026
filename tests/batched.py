"""Many `distft train` runs in one launch: the ranks join one gloo group once, then train every case
one after another on it, each in a folder of its own.

A case is a `distft train` command line and runs as that command does: the launching command's
part (the config and its derived defaults, the checks, every data row and the token cache, the
plan's prediction; `distft.train.command.prepared`) on rank 0, its config sent to every rank, then
the training loop on each (`distft.train.loop.train`: set-up, steps, checkpoints, resume, export),
on the group the ranks already hold (`DistEnv.owns_group`). What a launch per run would add is the
part that costs and proves nothing here: forking the ranks and meeting at a new rendezvous (a
3-step DDP parity run of micro on the idle 2-core machine: 1.6 s launched, 1.1 s on a group that
stands). The launches themselves are proven by the tests that still make them (tests/test_launch.py,
the CLI parity runs of each strategy's own file).

A case that fails leaves its traceback in its folder (`failure`) and the next case runs: the test of
each case then fails by its own name.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from distft.cli import build_parser, parse
from distft.config import Config
from distft.train.command import config_from_args, prepared
from distft.train.loop import train
from tests.helpers import free_port, spawn

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


@dataclass(frozen=True)
class Batch:
    """What the cases of one launch left beside their runs: each one's output and failure, by name."""

    logs: Path

    def folder(self, name: str) -> Path:
        return self.logs / name.replace("/", "_").replace(" ", "_")

    def failure(self, name: str) -> str | None:
        """The tracebacks case `name` left, rank by rank, with its output (None: it trained)."""
        errors = sorted(self.folder(name).glob("error-*.txt"))
        if not errors:
            return None
        logs = "".join(log.read_text()[-3000:] for log in sorted(self.folder(name).glob("output-*.txt")))
        return "".join(e.read_text() for e in errors) + "\n" + logs

    def output(self, name: str, rank: int = 0) -> str:
        """What rank `rank` printed while it ran case `name` (rank 0's includes the launching command's)."""
        return (self.folder(name) / f"output-{rank}.txt").read_text()


def run_cases(cases: dict[str, list[str]], world: int, logs: Path, timeout: int = 900) -> Batch:
    """Train each case (`name -> distft train ARGS`, its --out or --resume among them) on `world`
    ranks of one launch, in order."""
    batch = Batch(logs)
    folders = [batch.folder(name) for name in cases]
    for folder in folders:
        folder.mkdir(parents=True)
    runs = list(cases.values())
    spawn(_rank, (world, free_port(), runs, [str(f) for f in folders]), nprocs=world, timeout=timeout)
    return batch


def trained(cases: dict[str, list[str]], world: int, logs: Path, timeout: int = 900) -> Batch:
    """`run_cases`, failing the test with the tracebacks of every case that did not train."""
    batch = run_cases(cases, world, logs, timeout)
    failed = {name: batch.failure(name) for name in cases if batch.failure(name)}
    assert not failed, "\n".join(f"{name}:\n{error}" for name, error in failed.items())
    return batch


def _rank(rank: int, world: int, port: int, runs: list[list[str]], folders: list[str]) -> None:
    env = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world, "GROUP_RANK": 0}
    os.environ.update({name: str(value) for name, value in env.items()})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A case that fails on one rank leaves the others in a collective: the timeout frees them, and
    # the next case starts on every rank.
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", timeout=timeout, world_size=world, rank=rank)
    for args, folder in zip(runs, folders, strict=True):
        with _output_in(Path(folder, f"output-{rank}.txt")):
            try:
                sent = [_launched(args) if rank == 0 else None]
                dist.broadcast_object_list(sent, src=0)
                if isinstance(sent[0], str):  # the launching command refused it
                    raise RuntimeError(f"refused before launch (rank 0's error)\n{sent[0]}")
                train(sent[0])
            except BaseException:  # the case fails by its name; the next one runs
                Path(folder, f"error-{rank}.txt").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        dist.barrier()
    dist.destroy_process_group()


def _launched(args: list[str]) -> Config | str:
    """What `distft train ARGS` settles before it launches the ranks (as the command, not a rank):
    the config, or the error that refused it."""
    hidden = {name: os.environ.pop(name) for name in TORCHRUN}
    try:
        parsed = parse(build_parser(), ["train", *args])  # as `distft.cli.main` reads it
        return prepared(config_from_args(parsed), parsed)
    except BaseException:  # argparse's exit too: every rank must reach the broadcast
        return traceback.format_exc()
    finally:
        os.environ.update(hidden)


@contextlib.contextmanager
def _output_in(path: Path) -> Iterator[None]:
    """Descriptors 1 and 2 (and Python's streams) on `path` while a case runs."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(file, 1)
    os.dup2(file, 2)
    os.close(file)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)
