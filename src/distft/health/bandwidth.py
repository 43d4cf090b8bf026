"""All-reduce bandwidth per message size, on the run's backend: what `distft doctor` tabulates.

Each size is all-reduced a few times untimed (NCCL builds its rings and channels on first use),
then `iterations` times between two synchronisations; a size's time is the slowest rank's mean.
Two bandwidths are reported, as nccl-tests does:

- algorithm bandwidth `algbw = bytes / time`: what a caller sees;
- bus bandwidth `busbw = algbw x 2 (n - 1) / n`: a ring all-reduce sends and receives each byte
  2 (n - 1) / n times per rank, so busbw is the rate each rank's link ran at, comparable to the
  hardware's figure (NVLink, InfiniBand, Ethernet) whatever the number of ranks n.

Small messages measure latency (the time stays flat as the size grows), large ones bandwidth (the
time grows with the size). A multi-node job whose large-message busbw is far below the slowest
link between its nodes has a misconfigured network (`distft.health.network`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distft.distributed import DistEnv, synchronize

WARMUP = 2


@dataclass(frozen=True)
class Bandwidth:
    bytes: int  # of one all-reduce's buffer (float32)
    seconds: float  # one all-reduce: the slowest rank's mean over the timed iterations
    iterations: int
    world_size: int

    @property
    def algbw(self) -> float:
        """Bytes per second as the caller sees them."""
        return self.bytes / self.seconds

    @property
    def busbw(self) -> float:
        """Bytes per second on each rank's link (ring all-reduce: 2 (n - 1) / n of the buffer each way)."""
        return self.algbw * 2 * (self.world_size - 1) / self.world_size


def default_iterations(size: int) -> int:
    """About 512 MiB moved per size, between 3 and 20 all-reduces: seconds on a CPU, less on GPUs."""
    return max(3, min(20, 512 * 1024**2 // size))


def measure_all_reduce(env: DistEnv, sizes: list[int], iterations: int = 0) -> list[Bandwidth]:
    """Time all-reduces of each size on every rank (a collective: every rank calls it alike);
    `iterations` 0: `default_iterations` per size."""
    results = []
    for size in sizes:
        n = iterations or default_iterations(size)
        buffer = torch.zeros(max(1, size // 4), dtype=torch.float32, device=env.device)  # zeros stay finite
        for _ in range(WARMUP):
            dist.all_reduce(buffer)
        synchronize(env)
        dist.barrier()  # every rank starts the clock together
        start = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(buffer)
        synchronize(env)
        elapsed = torch.tensor([(time.perf_counter() - start) / n], dtype=torch.float64, device=env.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time is the collective's
        results.append(Bandwidth(buffer.numel() * 4, elapsed.item(), n, env.world_size))
    return results
