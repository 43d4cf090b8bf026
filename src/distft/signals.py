"""Ctrl-C and SIGTERM: a run stops at a step boundary, checkpoints, and says how to resume.

SIGINT (Ctrl-C) and SIGTERM (what a batch scheduler sends before it kills) get one handler in
every process of `distft train`; what it does depends on where the process is:

- Before the loop (checks before launch, process group, model build): it raises `Interrupted`,
  which `distft.exits` reports in one line (exit code 128 + the signal: 130, 143). Files are
  written atomically (`distft.io.files`), so nothing is left half-written.
- In the loop (`deferred()`): it only records the signal. The loop asks after each step whether
  any rank has one (`distft.train.loop`), so every rank stops after the same step, writes a
  checkpoint, and the main rank prints the step, the checkpoint and the command that resumes.
  A phase without steps (the reference scoring, a validation, the export) asks before each of its
  batches (`distft.train.boundary.agreed_signal`) and stops every rank at the same one.
- In torchrun's agent (`distft.launch`): the first raises torch's `SignalException`, which makes
  the agent send the same signal to its ranks and wait for them to stop.

The same signal often arrives twice: Ctrl-C in a terminal (or Slurm) signals every process, and
the agent then forwards it to ranks that already have it. A repeat within `ECHO_S` seconds is that
echo and is ignored. A later one is a second Ctrl-C: the process leaves at once (`os._exit`, no
traceback, no checkpoint), and an agent forwards it to its ranks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

HANDLED = (signal.SIGINT, signal.SIGTERM)
ECHO_S = 2.0  # a repeat sooner than this is the launcher forwarding what this process already has


def exit_code(signum: int) -> int:
    """The shell's convention: 128 + the signal's number (SIGINT 130, SIGTERM 143)."""
    return 128 + signum


def name(signum: int) -> str:
    return signal.Signals(signum).name


class Interrupted(BaseException):
    """SIGINT or SIGTERM before the loop. A BaseException, as KeyboardInterrupt is: no `except
    Exception` on the way up swallows it."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {name(signum)}")
        self.signum = signum


class _State:
    signum: int | None = None  # the first signal received
    at = 0.0  # when (time.monotonic)
    deferring = False  # in the loop: record, do not raise
    first: Callable[[int], None] | None = None  # what the first signal does outside the loop
    later: Callable[[int], None] | None = None  # what a second one does (None: leave at once)


_state = _State()  # one per process; its fields are set on the instance


def _handler(signum: int, frame: object) -> None:
    now = time.monotonic()
    if _state.signum is None:
        _state.signum, _state.at = signum, now
        if _state.deferring:
            return
        if _state.first is not None:
            _state.first(signum)
            return
        raise Interrupted(signum)
    if now - _state.at < ECHO_S:
        return  # the echo of the first
    if _state.later is not None:
        _state.later(signum)
        return
    leave_now(signum)


def leave_now(signum: int) -> None:
    """A second signal: end this process now, in one line (on the main rank) and no traceback."""
    if os.environ.get("RANK", "0") == "0":
        print(
            f"distft: a second {name(signum)}: stopped at once, without a checkpoint of the step in progress.",
            file=sys.stderr,
            flush=True,
        )
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os._exit(exit_code(signum))


@contextlib.contextmanager
def handling(
    first: Callable[[int], None] | None = None, later: Callable[[int], None] | None = None
) -> Iterator[None]:
    """Handle SIGINT and SIGTERM inside, with nothing received yet; the previous handlers after.

    Default: the first raises `Interrupted` (records only, inside `deferred()`), a second leaves
    at once. `first(signum)` and `later(signum)` replace those (the agent's and the launcher's).
    Off the main thread (where Python cannot set handlers) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = dict(vars(_state))
    previous = {sig: signal.getsignal(sig) for sig in HANDLED}
    _state.signum, _state.at, _state.deferring = None, 0.0, False
    _state.first, _state.later = first, later
    for sig in HANDLED:
        signal.signal(sig, _handler)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        vars(_state).clear()
        vars(_state).update(saved)


_before_start: dict[int, object] = {}


def _leave_while_starting(signum: int, frame: object) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(
            f"distft: stopped by {name(signum)} while starting; nothing was written.",
            file=sys.stderr,
            flush=True,
        )
    os._exit(exit_code(signum))


def starting() -> None:
    """Until `started()`: SIGINT/SIGTERM end the command at once, in one line. For the seconds a
    command spends importing torch, transformers and peft (its module, which `distft.cli` imports
    before it runs the command); nothing is written then. Only where distft is the program
    (`distft.cli` checks), never in a caller's process."""
    for sig in HANDLED:
        _before_start[sig] = signal.signal(sig, _leave_while_starting)


def started() -> None:
    """The handlers from before `starting()` again (a no-op without it)."""
    for sig, handler in _before_start.items():
        signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    _before_start.clear()


def is_the_program() -> bool:
    """Whether this process is `distft` itself: the console script, `python -m distft`, or
    `python -m distft.cli` (a rank torchrun exec'd); not a program that imports it."""
    argv = getattr(sys, "orig_argv", sys.argv)
    if len(argv) > 2 and argv[1] == "-m":
        return argv[2] in ("distft", "distft.cli")
    return len(argv) > 1 and os.path.basename(argv[1]) == "distft"


def received() -> int | None:
    """The signal this process received since `install`, if any."""
    return _state.signum


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Inside: a signal is only recorded, for the loop to act on at its next step boundary."""
    before = _state.deferring
    _state.deferring = True
    try:
        yield
    finally:
        _state.deferring = before


def forward_to(pids: Callable[[], list[int]]) -> Callable[[int], None]:
    """A handler that sends the signal on to the processes `pids()` names (gone ones skipped)."""

    def forward(signum: int) -> None:
        for pid in pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    return forward


if is_the_program():  # the first distft module `distft.cli` imports, before torch
    starting()
