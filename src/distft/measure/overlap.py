"""How much of a step's communication ran under compute, from timestamps of the collectives' work.

`CommTimeline` is the byte counter (`distft.measure.comm.CommCounter`) that also keeps two
timelines of one step on this rank:

- **communication**: each collective from the moment its op is issued to the moment its work
  completes. A blocking c10d op (`async_op=False`: tp-sp's collectives, the loss and norm
  all-reduces) is its own call. An asynchronous one (DDP's reducer, FSDP2) returns a `Work`: the
  completion is the earliest of its future's callback and the return of a Python `Work.wait()` on
  it (FSDP2's coalesced gloo works have no future; its waits are in Python). Those waits are timed
  by patching torch's `Work.wait` (`time_work_waits`), done as the first timeline is entered,
  never on import; a work never seen complete is stamped at the step's end if it reports
  completion then. Functional collectives (DTensor, `tp`)
  return a tensor that a later `wait_tensor` waits for: their interval ends when that wait returns
  (an upper bound: the work may have finished earlier).
- **compute**: every other op this process dispatches, from call to return, on every thread the
  autograd engine uses; gaps shorter than `gap_s` (0.5 ms) between ops (Python between two kernels) count as
  compute, longer ones (a thread blocked in `Work.wait()`, DDP's end-of-backward wait in C++) do not.
  `wait_tensor` is a wait, not compute.

Per step: `comm_s` = the length of the union of the communication intervals (clipped to the step),
`comm_exposed_s` = the part of it during which no compute ran (the step waited for the network),
`overlap_fraction` = 1 - exposed / comm (null without communication).

What this can and cannot show: completion stamps are taken when the callback gets the GIL, so
they are late by however long the training thread held it. On a CPU with gloo the collectives run
on gloo's threads and compete for the same cores as the compute: "hidden" communication still
slows the compute it hides under, so a high overlap fraction here is not free time as it is on a
GPU, where NCCL kernels run on their own stream and SMs.
"""

from __future__ import annotations

import contextlib
import time

import torch

from distft.measure.comm import CommCounter

Interval = list[float]  # [start, end] in perf_counter seconds
_WAIT = torch.ops._c10d_functional.wait_tensor.default


class CommTimeline(CommCounter):
    """`begin()` at the start of a step, `summary()` at its end (also resets the timelines)."""

    def __init__(self, gap_s: float = 5e-4) -> None:
        super().__init__()
        self.gap_s = gap_s
        self.begin()

    def begin(self) -> None:
        self.start = time.perf_counter()
        self.compute: list[Interval] = []
        self.comm: list[Interval] = []  # end is inf until the work completes
        self._pending: dict[int, int] = {}  # id(functional collective output) -> index in comm
        self._works: list[tuple[object, int]] = []  # (Work, index in comm)
        self.blocked: list[Interval] = []  # this thread waiting: Python waits, wait_tensor
        self._break = False

    def on_op(self, func, args: tuple, start: float, end: float) -> None:
        if func is _WAIT:
            index = self._pending.pop(id(args[0]), None) if args else None
            if index is not None:
                self.comm[index][1] = end
            self.blocked.append([start, end])
            self._break = True
            return
        last = self.compute[-1] if self.compute else None
        if last is not None and start - last[1] <= self.gap_s and not self._break:
            last[1] = max(last[1], end)
        else:
            self.compute.append([start, end])
        self._break = False

    def on_collective(self, func, args: tuple, kwargs: dict, out: object, start: float, end: float) -> None:
        index = len(self.comm)
        self.comm.append([start, float("inf")])
        self._break = True  # the next op starts a new compute interval
        if isinstance(out, torch.Tensor):  # functional: completed by its wait_tensor
            self._pending[id(out)] = index
            return
        work = out[-1] if isinstance(out, tuple) and out else out
        if not isinstance(work, torch.ScriptObject):
            self.comm[index][1] = end
            return
        work = torch._C._distributed_c10d.Work.unbox(work)
        self._works.append((work, index))  # keeps the wrapper alive
        with contextlib.suppress(RuntimeError):  # "getFuture not implemented": gloo's coalesced works
            work.get_future().then(lambda _f, i=index: self._complete(i))

    def __enter__(self):
        global _ACTIVE
        time_work_waits()  # once per process; the completion stamps of Python waits need it
        _ACTIVE = self
        return super().__enter__()

    def __exit__(self, *exc):
        global _ACTIVE
        _ACTIVE = None
        return super().__exit__(*exc)

    def waited(self, began: float, now: float) -> None:
        """A Python `Work.wait()` blocked this thread from `began` to `now` (`time_work_waits`). Every
        collective issued before it began has completed by `now`: gloo runs a group's collectives
        in the order they were issued (and some of its works never report completion)."""
        self.blocked.append([began, now])
        self._break = True
        for interval in self.comm:
            if interval[0] <= began and interval[1] > now:
                interval[1] = now

    def _poll(self, now: float) -> None:
        """Works still open that report completion: stamped now (an upper bound)."""
        for work, index in self._works:
            if self.comm[index][1] == float("inf") and work.is_completed():
                self.comm[index][1] = now

    def _complete(self, index: int) -> None:
        now = time.perf_counter()
        self.comm[index][1] = min(self.comm[index][1], now)

    def summary(self) -> dict[str, float | None]:
        """This step's communication, exposed communication and overlap; starts the next step."""
        end = time.perf_counter()
        self._poll(end)
        comm = union([[max(a, self.start), min(b, end)] for a, b in self.comm])
        compute = union([[max(a, self.start), min(b, end)] for a, b in self.compute])
        compute = subtract(compute, union(self.blocked))
        total = length(comm)
        exposed = total - length(intersect(comm, compute))
        self.begin()
        return {
            "comm_s": total,
            "comm_exposed_s": exposed,
            "overlap_fraction": 1.0 - exposed / total if total > 0 else None,
        }


_ACTIVE: CommTimeline | None = None
_WORK = torch._C._distributed_c10d.Work
_work_wait = _WORK.wait  # torch's own, which `_timed_wait` calls


def _timed_wait(self, *args, **kwargs):
    began = time.perf_counter()
    result = _work_wait(self, *args, **kwargs)
    if _ACTIVE is not None:
        _ACTIVE.waited(began, time.perf_counter())
    return result


def time_work_waits() -> None:
    """Route every Python `Work.wait()` (FSDP2's unshard, torch.distributed's async handles) through
    `_timed_wait`, which stamps the active `CommTimeline`. torch's `Work` class is patched, for the
    whole process, only here: importing distft changes nothing in torch. Idempotent; a wait outside
    a timeline costs two clock reads. `CommTimeline.__enter__` calls it."""
    if _WORK.wait is not _timed_wait:
        _WORK.wait = _timed_wait


def union(intervals: list[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time; empty ones dropped."""
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def intersect(xs: list[Interval], ys: list[Interval]) -> list[Interval]:
    """The overlap of two sorted, disjoint interval lists."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append([a, b])
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(xs: list[Interval], ys: list[Interval]) -> list[Interval]:
    """The parts of sorted, disjoint `xs` outside sorted, disjoint `ys`."""
    out = []
    for a, b in xs:
        for c, d in ys:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append([a, c])
            a = max(a, d)
        if a < b:
            out.append([a, b])
    return out


def length(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in intervals)
