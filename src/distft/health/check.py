"""The pre-flight health check: a roll call with a timeout, then one timed all-reduce.

A multi-node job that is going to fail usually fails at its first collective: a rank stuck before
it, a node the others cannot reach. Unchecked, that is step 1's all-reduce timing out after
`parallel.timeout_s` (ten minutes by default) with a message that names no one. `check_health`
runs once, after `init_process_group` and before the model is built (`distft.train.setup`; alone
in `distft doctor`), and names the rank instead:

1. Roll call, a barrier with a timeout. Every rank writes its place (node, host, local rank) to
   the rendezvous store `init_process_group` met on, adds itself to a counter, and waits for the
   counter to reach the world size. After `parallel.health_timeout_s` the missing ranks are named,
   each with its host taken from a rank of the same node that did answer: "rank 3 (node 1, host
   gpu-b, local rank 1) did not join the health check within 30 s". The store answers alike under
   NCCL and gloo and needs no collective. (gloo's `monitored_barrier` names missing ranks too, but
   not their hosts, and a CUDA run would need a second, gloo, process group for it.)
2. One timed all-reduce of ones on the run's own backend (under NCCL the run's first collective:
   where a wrong network interface hangs), checked to sum to the world size. Every rank leaves an
   all-reduce at about the same moment, once the last one has joined, so the rank that joined last
   waited least: rank i joined `max(wait) - wait_i` after the first, and no two hosts' clocks are
   compared. A rank later than the first by more than `parallel.health_slow_s` is named: a
   warning in `distft train` (every collective of the run would wait for it), an error in
   `distft doctor`.
3. Device facts, in the same all-gather: each rank's device (kind, model, memory, compute
   capability), its torch, transformers, peft, Python and distft versions (`distft.health.facts`).
   Ranks that differ are named in a `HealthError`, or a warning with `parallel.allow_mixed`.

What it cannot see: a rank that never starts (torchrun's rendezvous waits for its agent, and
`init_process_group` for every rank, up to `parallel.timeout_s`), and a slow link (in a ring
all-reduce every rank waits for the slowest link alike; `distft doctor`'s bandwidth table shows it).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from distft.config import ParallelConfig
from distft.distributed import DistEnv, answered_place, naming_collective, roll_call, synchronize
from distft.errors import HealthError
from distft.health.facts import REMEDY, device_facts, mixed_facts
from distft.health.network import failure_advice
from distft.text import plural

PROBE_NUMEL = 1024  # the all-reduce's float32 elements (4 KiB): latency, not bandwidth
MAX_NAMED = 8  # missing or slow ranks named one by one; the rest are counted


def _nothing(rank: int) -> None:
    return None


def _same(rank: int, facts: dict) -> dict:
    return facts


@dataclass(frozen=True)
class HealthHooks:
    """Points inside the check where a test injects a fault (`TrainHooks.health`, installed through
    `DISTFT_HOOKS`: `distft.train.hooks`); no-ops by default."""

    before_roll_call: Callable[[int], None] = _nothing
    """`before_roll_call(rank)`: as the check begins (a rank that sleeps here never joins)."""
    before_all_reduce: Callable[[int], None] = _nothing
    """`before_all_reduce(rank)`: after the roll call (a rank that sleeps here joins late)."""
    device_facts: Callable[[int, dict], dict] = _same
    """`device_facts(rank, facts)`: this rank's device facts as gathered (a test changes a version)."""


@dataclass(frozen=True)
class RankPlace:
    """Where a rank runs: its node (--node-rank), that node's host name, its local rank."""

    rank: int
    node: int
    host: str
    local_rank: int

    def __str__(self) -> str:
        return f"rank {self.rank} (node {self.node}, host {self.host}, local rank {self.local_rank})"


@dataclass(frozen=True)
class HealthReport:
    """What every rank learns from a passed roll call and all-reduce."""

    places: list[RankPlace]  # every rank's, by rank
    roll_call_s: float  # this rank's wait until the last rank answered
    waits_s: list[float]  # each rank's time inside the all-reduce
    slow_s: float  # parallel.health_slow_s
    facts: list[dict] = field(default_factory=list)  # every rank's device facts (`distft.health.facts`)
    mixed: str | None = None  # the ranks whose device or software differs, where allowed (a warning)

    @property
    def late_s(self) -> list[float]:
        """How long after the first rank each rank joined the all-reduce (the roll call had just
        released them all together, so a healthy rank is a few milliseconds behind at most)."""
        return [max(self.waits_s) - w for w in self.waits_s]

    @property
    def slow(self) -> list[RankPlace]:
        return [p for p, late in zip(self.places, self.late_s, strict=True) if late > self.slow_s]

    def slow_messages(self) -> list[str]:
        late = self.late_s
        return [
            f"{p} joined the health check's all-reduce {late[p.rank]:.1f} s after the first rank "
            f"(the limit is {self.slow_s:g} s): it is overloaded or slower to start than the others, and "
            "every collective of the run would wait for it."
            for p in self.slow[:MAX_NAMED]
        ] + ([f"... and {len(self.slow) - MAX_NAMED} more slow ranks."] if len(self.slow) > MAX_NAMED else [])

    def warnings(self) -> list[str]:
        """What `distft train` prints under its header: slow ranks, and mixed ranks it was allowed."""
        return self.slow_messages() + (
            [f"{self.mixed} Going on: parallel.allow_mixed=true."] if self.mixed else []
        )

    def summary(self) -> str:
        hosts = {p.node: p.host for p in self.places}
        where = ", ".join(f"node {n} on {h}" for n, h in sorted(hosts.items())) if len(hosts) <= 4 else ""
        late = self.late_s
        last = max(range(len(late)), key=late.__getitem__)
        # The last rank to join waited for no one: its wait is the all-reduce's own latency.
        return (
            f"health check: {len(self.places)} ranks on {plural(len(hosts), 'node')}{f' ({where})' if where else ''} "
            f"answered in {self.roll_call_s:.2f} s; a {PROBE_NUMEL * 4 // 1024} KiB all-reduce took "
            f"{1e3 * min(self.waits_s):.1f} ms once all had joined; the last to join, rank {last}, was "
            f"{late[last]:.2f} s behind the first"
        )


def check_health(env: DistEnv, p: ParallelConfig, hooks: HealthHooks | None = None) -> HealthReport:
    """Roll call, then the timed all-reduce, on every rank; `HealthError` names missing ranks."""
    hooks = hooks or HealthHooks()
    place = RankPlace(env.rank, env.node, socket.gethostname(), env.local_rank)
    store = _check_store(env)
    hooks.before_roll_call(env.rank)
    roll_call_s = roll_call(store, env.rank, env.world_size, asdict(place), p.health_timeout_s)
    if roll_call_s is None:
        raise _missing_ranks(store, env, p.health_timeout_s)
    hooks.before_all_reduce(env.rank)

    def advice() -> str:
        return failure_advice(os.environ, env.backend)

    facts = hooks.device_facts(env.rank, device_facts(env.device))
    with naming_collective(env, "the health check's all-reduce", p.timeout_s, advice):
        wait_s = _timed_all_reduce(env)
        gathered: list[tuple[dict, float, dict] | None] = [None] * env.world_size
        dist.all_gather_object(gathered, (asdict(place), wait_s, facts))
    places = [RankPlace(**place) for place, _, _ in gathered]  # all_gather_object fills every slot
    every_facts = [f for _, _, f in gathered]
    mixed = mixed_facts(every_facts)
    if mixed and not p.allow_mixed:
        error = HealthError(f"{mixed} {REMEDY}")
        error.every_rank = False  # every rank gathered the same table; rank 0 reports
        raise error
    waits = [wait for _, wait, _ in gathered]
    return HealthReport(places, roll_call_s, waits, p.health_slow_s, every_facts, mixed)


# ---- 1. the roll call ---------------------------------------------------------------------------


def _check_store(env: DistEnv) -> dist.Store:
    """The store every rank met on in `init_process_group`, under a fresh prefix for each check."""
    # Private in torch, but it is the one store every rank already shares, under NCCL and gloo,
    # and (under torchrun) already prefixed by the restart attempt.
    store = dist.distributed_c10d._get_default_store()
    check = store.add(f"distft/health/checks/{env.rank}", 1)  # every rank counts its own checks alike
    return dist.PrefixStore(f"distft/health/{check}", store)


def _missing_ranks(store: dist.Store, env: DistEnv, timeout_s: float) -> HealthError:
    """The error naming every rank that did not answer, raised by the lowest rank that did (the
    others raise it too, unprinted: reading every rank's key from every rank would flood the store)."""
    if any(answered_place(store, r) for r in range(env.rank)):
        error = HealthError(
            f"Rank {env.rank}: the health check's roll call timed out (a lower rank names who is missing)."
        )
        error.every_rank = False
        return error
    answered = {r: RankPlace(**place) for r in range(env.world_size) if (place := answered_place(store, r))}
    hosts = {p.node: p.host for p in answered.values()}
    missing = [
        RankPlace(
            r,
            r // env.local_world_size,
            hosts.get(r // env.local_world_size, "unknown: no rank of that node answered"),
            r % env.local_world_size,
        )
        for r in range(env.world_size)
        if r not in answered
    ]
    named = "; ".join(map(str, missing[:MAX_NAMED])) + (
        f"; and {len(missing) - MAX_NAMED} more" if len(missing) > MAX_NAMED else ""
    )
    error = HealthError(
        f"The pre-flight health check: {named} did not join within {timeout_s:g} s ({len(answered)} of "
        f"{env.world_size} ranks did). A rank that stalls here is stuck or dead since it joined the process "
        "group: its own output, if it left any, is above. If it is only slow to start, raise the timeout "
        "(parallel.health_timeout_s; distft doctor --timeout-s); parallel.health_check=false skips the check."
    )
    error.every_rank = True  # the lowest rank that answered, which may not be rank 0
    return error


# ---- 2. the timed all-reduce ---------------------------------------------------------------------


def _timed_all_reduce(env: DistEnv) -> float:
    """Seconds this rank spent in one all-reduce of ones, checked to sum to the world size."""
    ones = torch.ones(PROBE_NUMEL, device=env.device)
    synchronize(env)
    start = time.perf_counter()
    dist.all_reduce(ones)
    synchronize(env)
    wait_s = time.perf_counter() - start
    if not torch.all(ones == env.world_size):
        raise HealthError(
            f"Rank {env.rank}: the health check's all-reduce of ones summed to {ones.min().item():g}, not the "
            f"world size {env.world_size}: the {env.backend} backend returns wrong results on this node. "
            f"{failure_advice(os.environ, env.backend)}".strip()
        )
    return wait_s
