"""How every command ends: one line on stderr and an exit code, never a traceback.

| exit | when |
|---|---|
| 0 | done |
| 1 | a failure while running (`TrainingError`), a disk error, or a bug |
| 2 | a user error found before anything ran (`ConfigError`, `DataError`, `DamagedFileError`, ...) |
| 130, 143 | stopped by SIGINT / SIGTERM (`distft.signals`) |

`DISTFT_DEBUG=1` prints the traceback as well. A rank under torchrun ends in `exit_worker`.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

from distft import signals
from distft.errors import ConfigError, TrainingError

EXIT_FAILURE = 1
EXIT_USAGE = 2
DEBUG_ENV = "DISTFT_DEBUG"  # set to 1: a failure prints its traceback as well
FORKED_ENV = "DISTFT_FORKED_RANK"  # set in ranks forked by `distft.launch` (CPU runs)


OUT_OF_MEMORY = "out of memory"
MEMORY_ADVICE = (
    "Lower train.micro_batch_size or data.max_length, set model.activation_checkpointing=full, use "
    "--method qlora, or shard over more devices (--strategy fsdp); `distft train --dry-run` prints the "
    "plan's estimate of this run and `--strategy auto` picks a layout that fits."
)


def out_of_memory(err: BaseException) -> bool:
    """An allocation that failed: torch's CUDA out-of-memory, Python's MemoryError, or the CPU
    allocator's RuntimeError."""
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return True
    return isinstance(err, RuntimeError) and (
        any(s in str(err).lower() for s in ("out of memory", "not enough memory", "can't allocate memory"))
    )


def _notes(err: BaseException) -> str:
    """What was added on the way up (`add_note`: the trained weights safe, `distft.train.loop`)."""
    return "".join(f" {note}" for note in getattr(err, "__notes__", ()))


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0].rstrip(".") if str(err).strip() else ""


def run_command(command: str, handler: Callable[[], int]) -> int:
    """Run a command; whatever goes wrong ends in one paragraph on stderr and an exit code, never a
    traceback (`DISTFT_DEBUG=1` prints the traceback too). A run stopped by SIGINT/SIGTERM exits
    with 130/143 (`distft.signals`)."""
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    main_rank = os.environ.get("RANK", "0") == "0"
    try:
        return handler()
    except ConfigError as err:  # the user's to fix: found before anything ran
        if debug:
            traceback.print_exc()
        print(f"distft {command}: error: {err}{_notes(err)}", file=sys.stderr)
        return EXIT_USAGE
    except TrainingError as err:
        if debug:
            traceback.print_exc()
        if signum := signals.received():  # a peer that stopped before the loop, or the agent stopping ranks
            if main_rank:
                print(f"distft {command}: stopped by {signals.name(signum)}: {err}", file=sys.stderr)
            return signals.exit_code(signum)
        if err.every_rank or main_rank:
            print(f"distft {command}: error: {err}", file=sys.stderr)
        return EXIT_FAILURE
    except signals.Interrupted as stop:  # before the first step: set-up, or the checks before launch
        if main_rank:
            print(
                f"distft {command}: stopped by {signals.name(stop.signum)} before the first step; no step "
                "ran, and nothing was left half-written.",
                file=sys.stderr,
            )
        return signals.exit_code(stop.signum)
    except Exception as err:  # a fault no check foresaw (a disk error, a bug): said plainly
        if debug and "RANK" not in os.environ:  # one process: the real exception, as Python shows it
            raise
        if debug:  # a rank: its launcher keeps a raised exception to itself, so it is printed here
            traceback.print_exc()
        if out_of_memory(err):  # the plan said it fits, or --force launched it: the usual ways out
            print(  # by the rank that ran out, whichever it is
                f"distft {command}: error: {OUT_OF_MEMORY} ({_first_line(err) or type(err).__name__})."
                f"{_notes(err)} {MEMORY_ADVICE}",
                file=sys.stderr,
            )
            return EXIT_FAILURE
        text = _first_line(err)
        hint = (
            f"Rerun with {DEBUG_ENV}=1 for the traceback."
            if isinstance(err, OSError)  # the disk, a permission: the message says what
            else f"This is unexpected (a bug in distft, or a fault it does not know): rerun with "
            f"{DEBUG_ENV}=1 for the traceback, and report it."
        )
        if debug:
            hint = "Its traceback is above."
        print(f"distft {command}: error: {type(err).__name__}: {text}.{_notes(err)} {hint}", file=sys.stderr)
        return EXIT_FAILURE


def exit_worker(exit_code: int) -> None:
    """End a rank launched by torchrun hard, after flushing its output (no-op otherwise).

    gloo sometimes aborts a rank at interpreter shutdown ("terminate called without an active
    exception") after a good run, which torchrun reports as a failure. Outputs are flushed and the
    group destroyed first, so skipping the interpreter's teardown loses nothing. After a failed
    collective the group cannot be left cleanly at all; exiting hard is the only clean way out.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    # Set by torchrun only (not by a group of one). A forked rank returns instead: its launcher
    # waits for its return value, and multiprocessing ends it with `os._exit` right after.
    if "TORCHELASTIC_RUN_ID" in os.environ and FORKED_ENV not in os.environ:
        os._exit(exit_code)
