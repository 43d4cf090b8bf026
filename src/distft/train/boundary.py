"""The one collective between two steps: every rank's arrival time and its stop signal.

Two things at a step boundary need every rank's word. A straggler is told apart by when each rank
*arrives* (`distft.health.stragglers`), and a signal that reached some ranks, or reached them at
different steps, must stop all of them after the same step (`distft.signals`). Neither can ride the
step's own collectives: per strategy those run over subgroups or not at all.

So both ride one all-reduce (SUM) of `2 x world_size` float32s before each step, after its hooks
and its batch, just before its timing starts. Rank r writes slot r (seconds since every rank left
the previous boundary together) and slot `world_size + r` (the signal it received, 0 for none);
each rank writes only its own slots, so the sum is everyone's. Every rank then reads the same
largest signal and stops after the same step. It costs `8 x world_size` bytes a step, outside the
step's `step_time_s` and outside its `comm_bytes` (which count the step's own collectives, as
`comm_bytes_expected` predicts them). One process runs no collective: its own signal decides.

A phase without steps (the reference scoring, a validation, the export) asks before each of its
batches instead (`agreed_signal`): one all-reduce (MAX) of one float32, the same answer on every rank.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from distft import signals
from distft.distributed import DistEnv
from distft.health.stragglers import Finding, StragglerWindow


class StepBoundary:
    """The exchange before each step; `window` judges the arrival times (None: no monitor)."""

    def __init__(self, env: DistEnv, window: StragglerWindow | None):
        self.env = env
        self.window = window
        self._left: float | None = None  # when this rank left the previous boundary

    @classmethod
    def start(cls, env: DistEnv, window: int, ratio: float, names: list[str] | None = None) -> StepBoundary:
        """The boundary of this run; arrival times are judged in a multi-process run with `window` > 0."""
        judged = env.distributed and env.world_size > 1 and window > 0
        return cls(env, StragglerWindow(window, ratio, names or []) if judged else None)

    @property
    def collective(self) -> bool:
        """Whether crossing runs a collective (every rank must then cross every boundary)."""
        return self.env.distributed and self.env.world_size > 1

    def cross(self, step: int) -> tuple[list[Finding], int]:
        """Every rank, before step `step`: the stragglers named when a window completes, and the
        largest signal any rank received (0: none), the same on every rank."""
        mine = signals.received() or 0
        if not self.collective:
            return [], mine
        n, rank = self.env.world_size, self.env.rank
        slots = torch.zeros(2 * n, dtype=torch.float32, device=self.env.device)
        first = self._left is None
        slots[rank] = 0.0 if first else time.perf_counter() - self._left
        slots[n + rank] = float(mine)
        dist.all_reduce(slots)
        self._left = time.perf_counter()
        values = slots.tolist()
        signum = int(max(values[n:]))
        if first or self.window is None:  # step 1 has no previous boundary to time from
            return [], signum
        return self.window.add(step, values[:n]), signum

    def of(self, rank: int) -> dict | None:
        """What ranks.json says of `rank`: its worst ratio and the steps it was named for, or None."""
        return self.window.found.get(rank) if self.window else None


def agreed_signal(env: DistEnv) -> int:
    """The largest signal any rank received (0: none), the same on every rank: a stop between two
    batches of a phase without steps, where there is no step boundary to ride."""
    mine = float(signals.received() or 0)
    if not (env.distributed and env.world_size > 1):
        return int(mine)
    flag = torch.tensor([mine], device=env.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())
