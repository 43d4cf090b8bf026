"""Process-group set-up: device and backend come from the machine, ranks from torchrun.

Under torchrun every process finds RANK, WORLD_SIZE and LOCAL_RANK in its environment. With CUDA
present each process takes GPU `LOCAL_RANK` and talks NCCL; without it, the CPU and gloo. The same
code runs both ways unchanged. A single process (no torchrun) needs no process group at all.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: a single process without a process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def pick_device(requested: str = "auto", local_rank: int = 0) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("train.device=cuda but CUDA is not available on this machine.")
        return torch.device("cuda", local_rank)
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
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=dev if dev.type == "cuda" else None,
        )
    return DistEnv(rank, world_size, local_rank, dev, backend)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def shutdown(env: DistEnv, exit_code: int = 0) -> None:
    """Leave the group cleanly, then exit hard.

    gloo sometimes aborts a rank at interpreter shutdown ("terminate called without an active
    exception") after a good run, which torchrun reports as a failure. Outputs are flushed and the
    group destroyed first, so skipping the interpreter's teardown loses nothing.
    """
    if not env.distributed:
        return
    try:
        dist.barrier()
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if launched_by_torchrun():
            os._exit(exit_code)
