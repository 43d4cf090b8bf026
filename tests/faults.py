"""Fault injection for the tests, switched on by environment variables (never by the config).

The reliability tests need a rank that dies, a rank that hangs and a step that diverges, at a
known step, in a real multi-process run. Each is one environment variable; `from_environment()`
turns those that are set into `TrainHooks` for the loop, and returns None when none is set. distft
ships none of this: its one seam is `DISTFT_HOOKS=module:function` (`distft.train.hooks`), which
`distft train` and `distft doctor` read in every rank. `tests.helpers` sets `DISTFT_HOOKS` to
`HOOKS` (and puts this checkout on PYTHONPATH) for every run whose environment names a
DISTFT_FAULT_* variable; a test that trains in its own process sets it itself.

| variable                     | effect                                                             |
|------------------------------|--------------------------------------------------------------------|
| DISTFT_FAULT_KILL_AT_STEP=N  | rank DISTFT_FAULT_RANK sends itself SIGKILL as step N begins, as a  |
|                              | crashed machine would (no cleanup, no message)                     |
| DISTFT_FAULT_HANG_AT_STEP=N  | rank DISTFT_FAULT_RANK sleeps DISTFT_FAULT_HANG_S seconds (default  |
|                              | 3600, or until SIGINT/SIGTERM) as step N begins: a stuck rank, so  |
|                              | its peers wait in the next collective                              |
| DISTFT_FAULT_RAISE_AT_STEP=N | rank DISTFT_FAULT_RANK raises an unexpected error (KeyError) as     |
|                              | step N begins: a bug in one rank                                   |
| DISTFT_FAULT_NAN_AT_STEP=N   | every rank's gradients turn NaN after step N's backward            |
| DISTFT_FAULT_RAISE_IN=PHASE  | rank DISTFT_FAULT_RANK raises an unexpected error (KeyError) as     |
|                              | the first batch of PHASE begins: "reference" (the reference         |
|                              | scoring), "validation" or "export" (`TrainHooks.before_batch`)      |
| DISTFT_FAULT_SIGTERM_IN=PHASE| rank DISTFT_FAULT_RANK sends SIGTERM to itself, and to its launcher |
|                              | under torchrun (which forwards it to every rank), as the first      |
|                              | batch of PHASE begins; a later batch of PHASE in that rank raises:  |
|                              | the run should have stopped before it                              |
| DISTFT_FAULT_HEALTH_MISS=1   | rank DISTFT_FAULT_RANK sleeps DISTFT_FAULT_HANG_S seconds before   |
|                              | the health check's roll call: a rank that never joins it           |
| DISTFT_FAULT_HEALTH_LATE_S=S | rank DISTFT_FAULT_RANK sleeps S seconds before the health check's  |
|                              | all-reduce: a slow rank                                            |
| DISTFT_FAULT_DEVICE_FACTS=J  | rank DISTFT_FAULT_RANK reports the JSON object J over its device   |
|                              | facts to the health check, e.g. '{"torch": "2.12.0"}': a mixed job |
| DISTFT_FAULT_SLOW_RANK_S=S   | rank DISTFT_FAULT_RANK sleeps S seconds as every step begins: a    |
|                              | straggler (`train.straggler_window` names it)                      |
| DISTFT_FAULT_RANK=R          | the rank that dies, hangs or is late (default 1)                   |

Kill, hang, slow and the health faults strike on the first attempt only: torchrun's elastic agent sets
TORCHELASTIC_RESTART_COUNT to 1, 2, ... on restarts, and a restarted run must then finish, as it
would after a real, one-off fault. NaN strikes on every attempt (a diverging run diverges again).
"""

from __future__ import annotations

import json
import os
import signal
import time

import torch
from torch import nn

from distft import signals
from distft.distributed import restart_count
from distft.health import HealthHooks
from distft.tensors import local
from distft.train import TrainHooks

HOOKS = "tests.faults:from_environment"  # the value of DISTFT_HOOKS that installs these faults
PREFIX = "DISTFT_FAULT_"
VARIABLES = (
    "DISTFT_FAULT_KILL_AT_STEP",
    "DISTFT_FAULT_HANG_AT_STEP",
    "DISTFT_FAULT_RAISE_AT_STEP",
    "DISTFT_FAULT_NAN_AT_STEP",
    "DISTFT_FAULT_HEALTH_MISS",
    "DISTFT_FAULT_HEALTH_LATE_S",
    "DISTFT_FAULT_DEVICE_FACTS",
    "DISTFT_FAULT_SLOW_RANK_S",
    "DISTFT_FAULT_RAISE_IN",
    "DISTFT_FAULT_SIGTERM_IN",
)
_signalled: set[str] = set()  # the phases this process sent its SIGTERM in


def from_environment() -> TrainHooks | None:
    """The hooks the DISTFT_FAULT_* variables ask for, or None when none is set."""
    if not any(v in os.environ for v in VARIABLES):
        return None
    health = HealthHooks(
        before_roll_call=miss_roll_call, before_all_reduce=join_late, device_facts=other_facts
    )
    return TrainHooks(
        before_step=before_step, after_backward=poison_gradients, before_batch=before_batch, health=health
    )


def _at(variable: str, step: int) -> bool:
    value = os.environ.get(variable)
    return value is not None and int(value) == step


def _strikes(rank: int) -> bool:
    return not restart_count() and rank == int(os.environ.get("DISTFT_FAULT_RANK", "1"))


def before_step(step: int, rank: int) -> None:
    """Kill, stall or slow this rank as 1-based step `step` begins, if asked to."""
    if not _strikes(rank):
        return
    if _at("DISTFT_FAULT_KILL_AT_STEP", step):
        os.kill(os.getpid(), signal.SIGKILL)
    if _at("DISTFT_FAULT_RAISE_AT_STEP", step):
        raise KeyError("a planted fault")
    if _at("DISTFT_FAULT_HANG_AT_STEP", step):
        _stall(float(os.environ.get("DISTFT_FAULT_HANG_S", "3600")))
    if os.environ.get("DISTFT_FAULT_SLOW_RANK_S"):
        time.sleep(float(os.environ["DISTFT_FAULT_SLOW_RANK_S"]))


def before_batch(phase: str, batch: int, rank: int) -> None:
    """Raise, or send SIGTERM, as the first batch of `phase` begins, if asked to; a batch of it after
    that SIGTERM is a stop that came too late."""
    if phase in _signalled:
        raise KeyError(f"batch {batch} of the {phase} began after the planted SIGTERM")
    if not _strikes(rank) or batch:
        return
    if os.environ.get("DISTFT_FAULT_RAISE_IN") == phase:
        raise KeyError("a planted fault")
    if os.environ.get("DISTFT_FAULT_SIGTERM_IN") == phase:
        _signalled.add(phase)
        os.kill(os.getpid(), signal.SIGTERM)
        if "TORCHELASTIC_RUN_ID" in os.environ:  # the launcher, as a scheduler signals every process
            os.kill(os.getppid(), signal.SIGTERM)


def _stall(seconds: float) -> None:
    """Sleep `seconds`, or until a signal arrives: the agent stops the ranks left after a failure
    with SIGTERM, which in the loop only asks for a stop at the next step boundary (`distft.signals`);
    a rank stuck in a sleep would ignore it until SIGKILL, 30 s later."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and not signals.received():
        time.sleep(min(0.1, max(0.0, end - time.monotonic())))


def miss_roll_call(rank: int) -> None:
    """Stall this rank before the health check's roll call, if asked to: it never answers."""
    if _strikes(rank) and os.environ.get("DISTFT_FAULT_HEALTH_MISS"):
        time.sleep(float(os.environ.get("DISTFT_FAULT_HANG_S", "3600")))


def join_late(rank: int) -> None:
    """Delay this rank before the health check's all-reduce, if asked to: a slow rank."""
    if _strikes(rank) and os.environ.get("DISTFT_FAULT_HEALTH_LATE_S"):
        time.sleep(float(os.environ["DISTFT_FAULT_HEALTH_LATE_S"]))


def other_facts(rank: int, facts: dict) -> dict:
    """This rank's device facts with some replaced, if asked to: a rank unlike the others."""
    if _strikes(rank) and os.environ.get("DISTFT_FAULT_DEVICE_FACTS"):
        return {**facts, **json.loads(os.environ["DISTFT_FAULT_DEVICE_FACTS"])}
    return facts


def poison_gradients(model: nn.Module, step: int) -> None:
    """Fill every gradient with NaN in step `step`, on every rank, if asked to."""
    if not _at("DISTFT_FAULT_NAN_AT_STEP", step):
        return
    for p in model.parameters():
        if p.grad is not None:
            local(p.grad).fill_(torch.nan)
