"""Ranks kept for the suite's multi-process runs: `distft train --nproc N` trains on a standing group
of N gloo ranks instead of launching N new ones.

A launch costs the same whatever the run: fork the agent and the ranks, meet at a new rendezvous,
build the group (~2 s of the 2-core machine's time a run, for hundreds of runs). Here each pytest
worker starts, on its first `distft train`, one group of 2 ranks and one of 4, forked from the
server that imported distft (`tests.helpers`). The command itself still runs as a user runs it, in
a process of its own: it reads the config, checks everything, builds the token cache and predicts
the run; only where it would launch (`distft.launch.launch_ranks`) it hands `distft train --config
FILE` to the pool's rank 0 instead, which sends it to the others through the group's store. Every
rank then runs `distft.cli.main` on it, as a launched rank does (its environment, torchrun's
variables, the directory), on the group it holds (`DistEnv.owns_group`), its output appended to the
command's. The command's exit code is the launcher's: 0, or 1 with the launcher's summary line.

Between runs a rank drops what the last one built: torch.compile's caches and the run's own
process groups. What a launch itself must prove (torchrun's agent, restarts, signals, faults, many
nodes, 8 ranks) is not sent here: `run_cli` launches for real when a run names a fault, starts a
fresh interpreter, or asks for another world size, restarts or nodes (`pooled`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Client, Listener

import torch
import torch.distributed as dist

from distft.cli import main

WORLDS = (2, 4)
ADDRESS_ENV = "DISTFT_TEST_POOLS"  # the listening address of each world's rank 0, for the command
SWITCH = "DISTFT_TEST_POOL"  # =0: every run launches its ranks (to compare, or to rule the pool out)
TORCHRUN = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
_started: dict[int, list] = {}  # world -> its rank processes, in the test process
_folder = tempfile.mkdtemp(prefix="distft-pools-")


def addresses(fork: Callable, free_port: Callable[[], int], kill: Callable[[int], None]) -> str:
    """In the test process: the pools' addresses as `ADDRESS_ENV` holds them, each pool started on
    first use, and again if one of its ranks has ended (a run crashed it)."""
    for world in WORLDS:
        address = os.path.join(_folder, f"world-{world}")
        if any(p.exitcode is not None for p in _started.get(world, [])):
            stop(kill, [world])
        if world not in _started:
            port = free_port()
            _started[world] = [fork(_serve, rank, world, port, address) for rank in range(world)]
            while not os.path.exists(address):
                if any(p.exitcode is not None for p in _started[world]):
                    raise RuntimeError(f"the pool of {world} ranks ended while starting")
                time.sleep(0.01)
    return ";".join(f"{world}={os.path.join(_folder, f'world-{world}')}" for world in WORLDS)


def stop(kill: Callable[[int], None], worlds: Iterable[int] = WORLDS) -> None:
    """Kill pools (a run hung in one, or the test process ends): the next run starts them anew."""
    for world in worlds:
        for p in reversed(_started.pop(world, [])):  # rank 0, whose store the others wait on, last
            if p.exitcode is None:
                kill(p.pid)
            p.join()
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(_folder, f"world-{world}"))


def pooled(world: int, nnodes: int, max_restarts: int) -> str | None:
    """In the command's process: the address of the pool that runs this layout, if any."""
    if nnodes != 1 or max_restarts or "DISTFT_HOOKS" in os.environ:
        return None
    pools = dict(entry.split("=", 1) for entry in os.environ.get(ADDRESS_ENV, "").split(";") if entry)
    return pools.get(str(world))


def launch_in_pool(address: str, argv: list[str]) -> int:
    """In the command's process, where it would launch: the run on the pool's ranks; the exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    job = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
    job["stdout"], job["stderr"] = os.readlink("/proc/self/fd/1"), os.readlink("/proc/self/fd/2")
    with Client(address) as conn:
        conn.send(job)
        codes = conn.recv()
    if not any(codes):
        return 0
    failed = [(rank, code) for rank, code in enumerate(codes) if code]
    said = "; ".join(f"rank {rank}: exit code {code}" for rank, code in failed[1:])
    print(
        f"distft: the run failed. Rank {failed[0][0]} ended first (exit code {failed[0][1]})"
        + (f", then the others ({said})" if said else "")
        + ". The ranks' own messages, if they left any, are above.",
        file=sys.stderr,
    )
    return 1


def _serve(rank: int, world: int, port: int, address: str) -> None:
    """A pool rank: join the group, then run each job rank 0 receives, until killed."""
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(days=1))
    # A run that fails on one rank leaves the others in a collective: this frees them.
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("pool", store), rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    listener = Listener(address + ".tmp") if rank == 0 else None
    if listener:
        os.rename(address + ".tmp", address)  # whole, or not there: the test process waits on it
    home = dict(os.environ)
    for n in range(sys.maxsize):
        conn = listener.accept() if listener else None
        if conn:
            store.set(f"job-{n}", pickle.dumps(conn.recv()))
        job = pickle.loads(store.get(f"job-{n}"))
        store.set(f"code-{n}-{rank}", str(_run(job, rank, world, port, home)))
        if conn:
            conn.send([int(store.get(f"code-{n}-{r}")) for r in range(world)])
            conn.close()


def _run(job: dict, rank: int, world: int, port: int, home: dict[str, str]) -> int:
    """One rank of the run: `distft.cli.main` as torchrun would start it; its exit code."""
    os.environ.clear()
    os.environ.update(job["env"])
    torchrun = (rank, world, rank, world, 0, "127.0.0.1", port)
    os.environ.update({name: str(value) for name, value in zip(TORCHRUN, torchrun, strict=True)})
    os.chdir(job["cwd"])
    torch._dynamo.reset()  # compiled code of the last run, and its recompile counts
    try:
        with _output_to(job["stdout"], job["stderr"]):
            try:
                return main(job["argv"])
            except SystemExit as stop:
                return stop.code if isinstance(stop.code, int) else 1
            except BaseException:
                traceback.print_exc()
                return 1
    finally:
        _drop_run_groups()
        os.environ.clear()
        os.environ.update(home)


def _drop_run_groups() -> None:
    """The groups the run made (its mesh's dimensions), destroyed: the pool's own stays."""
    default = dist.distributed_c10d._get_default_group()
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not default:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)


@contextlib.contextmanager
def _output_to(stdout: str, stderr: str) -> Iterator[None]:
    """Descriptors 1 and 2 (and Python's streams) appended to the command's files while the run runs."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    for fd, path in ((1, stdout), (2, stderr)):
        file = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(file, fd)
        os.close(file)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)
