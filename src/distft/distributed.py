"""Process-group set-up: device and backend come from the machine, ranks from torchrun.

`distft.launch` starts a multi-process run; under torchrun every process then finds RANK,
WORLD_SIZE, LOCAL_RANK, GROUP_RANK (its node) and LOCAL_WORLD_SIZE in its environment. With CUDA
present each process takes GPU `LOCAL_RANK` and talks NCCL; without it, the CPU and gloo. The same
code runs both ways unchanged. A single process (no torchrun) needs no process group at all.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from distft.errors import (
    CheckpointError,
    CollectiveError,
    ConfigError,
    DamagedFileError,
    DataError,
    HealthError,
    TrainingError,
)
from distft.host_memory import keep_freed_memory

T = TypeVar("T")
# What `decided_by_rank_zero` re-raises on the other ranks, most specific first (`next` takes the
# exact class: its name is what travels).
DISTFT_ERRORS = (DamagedFileError, DataError, ConfigError, CheckpointError, TrainingError)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: a single process without a process group
    node: int = 0  # this node's index (torchrun's GROUP_RANK, i.e. --node-rank)
    local_world_size: int = 1  # processes per node (--nproc); rank = node x this + local rank
    owns_group: bool = True  # False: the caller started the group, and keeps it after the run

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def restart_count() -> int:
    """How many times torchrun's elastic agent has restarted this run's ranks (0: first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def wants_cuda(requested: str = "auto") -> bool:
    """Whether `train.device=requested` computes on a GPU: asked for, or `auto` where CUDA is."""
    return requested == "cuda" or (requested == "auto" and torch.cuda.is_available())


def pick_device(requested: str = "auto", local_rank: int = 0) -> torch.device:
    """The device this process computes on: GPU `local_rank` where CUDA is (or is asked for), else
    the CPU, where malloc is then told to keep what a step frees (`distft.host_memory`)."""
    if wants_cuda(requested):
        if not torch.cuda.is_available():
            raise RuntimeError("train.device=cuda but CUDA is not available on this machine.")
        return torch.device("cuda", local_rank)
    keep_freed_memory()
    return torch.device("cpu")


def init_distributed(device: str = "auto", timeout_s: int = 600, need_group: bool = False) -> DistEnv:
    """Join the process group torchrun set up, or describe the single process we are."""
    if not launched_by_torchrun() and not need_group:
        return DistEnv(0, 1, 0, pick_device(device), None)
    if not launched_by_torchrun():
        # A multi-process strategy at world size 1 (e.g. `--strategy ddp` on one GPU): a group of one.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = pick_device(device, local_rank)
    if dev.type == "cuda":
        check_local_gpu(local_rank, torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    owns_group = not dist.is_initialized()
    if owns_group:
        timeout = datetime.timedelta(seconds=timeout_s)
        store, rank, world_size = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        # Before the group: a rank on the CPU among ranks on GPUs would wait in gloo's set-up for
        # peers that set up NCCL, until the timeout, with a message that names no one.
        agree_on_devices(store, rank, world_size, dev.type == "cuda", timeout_s)
        dist.init_process_group(
            backend=backend,
            store=dist.PrefixStore("default_pg", store),  # what init_process_group's own rendezvous makes
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=dev if dev.type == "cuda" else None,
        )
    # Outside torchrun (a spawned test, a group of one) every rank counts as node 0.
    node, local_world_size = (
        int(os.environ.get("GROUP_RANK", 0)),
        int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
    )
    return DistEnv(rank, world_size, local_rank, dev, backend, node, local_world_size, owns_group)


def check_local_gpu(local_rank: int, gpus: int, visible: str | None) -> None:
    """A rank takes GPU LOCAL_RANK: one this process cannot see is named here, not left to CUDA's
    "invalid device ordinal" (or a hang in its peers)."""
    if local_rank < gpus:
        return
    shown = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "CUDA_VISIBLE_DEVICES unset"
    raise ConfigError(
        f"Rank {os.environ.get('RANK', '?')} (host {socket.gethostname()}, local rank {local_rank}) takes GPU "
        f"{local_rank}, but this process sees {gpus} GPU(s) ({shown}): --nproc is larger than the GPUs "
        "this node shows its processes. Lower --nproc to the GPU count, or make CUDA_VISIBLE_DEVICES list "
        "one GPU per process."
    )


def agree_on_devices(store: dist.Store, rank: int, world_size: int, on_cuda: bool, timeout_s: float) -> None:
    """Every rank counts itself in on the rendezvous store (`roll_call`), saying whether it took a
    GPU; ranks without one among ranks with one are named in a `HealthError` (all ranks raise it,
    rank 0 prints it). O(1) store operations per rank; each rank's place is read only to name them."""
    store = dist.PrefixStore(f"distft/devices/{restart_count()}", store)
    place = {
        "host": socket.gethostname(),
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        "cuda": on_cuda,
    }
    store.add("cuda", int(on_cuda))  # before answering: once all have answered, the count is whole
    if roll_call(store, rank, world_size, place, timeout_s) is None:
        return  # a rank missing: init_process_group waits for it too, and times out naming it
    gpus = store.add("cuda", 0)
    if gpus in (0, world_size):
        return
    places = [answered_place(store, r) for r in range(world_size)]
    error = HealthError(mixed_devices(places))
    error.every_rank = False
    raise error


def roll_call(store: dist.Store, rank: int, world_size: int, place: dict, timeout_s: float) -> float | None:
    """A barrier with a timeout on `store` (a fresh prefix per call): this rank writes its `place`
    (read back with `answered_place`) and counts itself in; the last rank to answer opens the gate.
    Seconds until every rank answered, or None after `timeout_s`. O(1) store operations per rank."""
    start = time.perf_counter()
    store.set(f"place/{rank}", json.dumps(place))
    if store.add("answered", 1) == world_size:
        store.set("all", "1")
    # Polled rather than `store.wait(keys, timeout)`, whose timeout logs C++ warnings on every rank.
    pause = 0.001
    while not store.check(["all"]):
        if time.perf_counter() - start > timeout_s:
            return None
        time.sleep(pause)
        pause = min(2 * pause, 0.1)
    return time.perf_counter() - start


def answered_place(store: dist.Store, rank: int) -> dict | None:
    """The place `rank` wrote in a `roll_call` on `store`, or None if it has not answered."""
    key = f"place/{rank}"
    return json.loads(store.get(key)) if store.check([key]) else None


def mixed_devices(places: list[dict]) -> str:
    """The paragraph naming the ranks without a GPU (`places[r]`: rank r's host, local rank, cuda)."""
    cpu = [r for r, p in enumerate(places) if not p["cuda"]]
    named = "; ".join(
        f"rank {r} (host {places[r]['host']}, local rank {places[r]['local_rank']})" for r in cpu[:8]
    )
    more = f" and {len(cpu) - 8} more" if len(cpu) > 8 else ""
    return (
        f"{named}{more} found no GPU and would run on the CPU (gloo), while the other "
        f"{len(places) - len(cpu)} of {len(places)} ranks run on GPUs (NCCL): the two cannot form one process "
        "group. On those hosts, check `nvidia-smi`, the driver and CUDA_VISIBLE_DEVICES (empty or -1 hides "
        "every GPU); or run every rank on the CPU with train.device=cpu."
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def synchronize(env: DistEnv) -> None:
    """Wait for this rank's queued device work (CUDA collectives return before they finish)."""
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)


def decided_by_rank_zero(env: DistEnv, decide: Callable[[], T]) -> T:
    """`decide()` on rank 0 alone, its answer broadcast to every rank: a refusal too, raised on every
    rank as the same distft error. What reads a lot to answer (a resume checksumming a checkpoint)
    is read once, not once per rank; and no rank can answer otherwise."""
    if not env.distributed:
        return decide()
    answer: list = [None]
    if env.is_main:
        try:
            answer = [("value", decide())]
        except DISTFT_ERRORS as err:
            answer = [("error", type(err).__name__, str(err))]
    dist.broadcast_object_list(answer, src=0)  # rank 0's own objects: no file is unpickled
    if answer[0][0] == "error":
        _, kind, message = answer[0]
        raise next(e for e in DISTFT_ERRORS if e.__name__ == kind)(message)
    return answer[0][1]


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def shutdown(env: DistEnv) -> None:
    """Leave the group cleanly (the process itself ends in `distft.exits.exit_worker`); a group the
    caller started stays up for its next use."""
    if env.distributed:
        dist.barrier()
        if env.owns_group:
            dist.destroy_process_group()


# Substrings of the errors gloo and NCCL raise when a peer is slow or gone (plain RuntimeErrors in
# torch 2.13 for gloo; `DistError` subclasses elsewhere).
_TIMEOUT = ("timed out", "timeout")
_LOST = ("connection closed", "connection reset", "broken pipe", "connection refused", "socket closed")


@contextlib.contextmanager
def naming_collective(
    env: DistEnv, what: str, timeout_s: float, advice: Callable[[], str] = str
) -> Iterator[None]:
    """Run collectives; a timeout or a lost peer becomes a `CollectiveError` naming rank and `what`.

    gloo honours the process group's timeout (`parallel.timeout_s`) but says only "Timed out
    waiting 600000ms for recv operation", and on NCCL the watchdog's message is no clearer:
    neither says which rank waited or for what. The loop wraps each phase of a step in this, with
    `what` naming the operation (e.g. "the all-reduce of gradients (ddp) in step 3's backward");
    `advice()` (what to do next) is appended.
    """
    if not env.distributed:
        yield
        return
    try:
        yield
    except CollectiveError:
        raise
    except Exception as err:
        text = str(err).lower()
        timed_out = any(s in text for s in _TIMEOUT)
        lost = any(s in text for s in _LOST)
        if not (timed_out or lost or isinstance(err, dist.DistError)):
            raise
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        detail = re.sub(r"^\[[^\]]*\]\s*", "", detail)  # gloo prefixes its source path: [.../pair.cc:598]
        if timed_out:
            what_happened = (
                f"waited more than parallel.timeout_s={timeout_s:g} s in {what} and gave up: another rank "
                "is stuck or gone"
            )
        else:
            what_happened = (
                f"lost its connection to another rank during {what}: that rank died (its own message, "
                "if it left one, is above)"
            )
        raise CollectiveError(
            f"Rank {env.rank} of {env.world_size} {what_happened} ({env.backend}: {detail}). {advice()}".strip()
        ) from None
