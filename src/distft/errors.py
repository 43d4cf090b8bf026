"""Every error distft reports to a user, in one place (no torch import: the CLI catches them).

Two families, told apart by when they happen and how the CLI exits:
- `ConfigError` (exit 2): a user error found before anything runs: a wrong config, an impossible
  strategy/model combination, a malformed dataset row. The message says what is wrong and how to
  fix it, in one paragraph.
- `TrainingError` (exit 1): a failure during training (a collective that timed out, a checkpoint
  that could not be written, a diverged step), reported as one paragraph, never a traceback.

`run_command` is where every command of the CLI ends: each of these, and anything else that
escapes (a disk error, a bug), becomes one line on stderr and an exit code.
"""

import os
import sys
import traceback
from collections.abc import Callable

from distft import signals

EXIT_FAILURE = 1
EXIT_USAGE = 2
DEBUG_ENV = "DISTFT_DEBUG"  # set to 1: a failure prints its traceback as well


class ConfigError(ValueError):
    """A user-facing configuration problem; the message says what is wrong and how to fix it."""


class DataError(ConfigError):
    """A dataset problem, reported with the file and line (or row) it comes from."""


class DamagedFileError(ConfigError):
    """A file a run wrote (an adapter, a model, a checkpoint) is cut short, altered or unreadable;
    the message names the file and what to do instead."""


class RunLockedError(ConfigError):
    """Another process is writing the run directory (its lock names the process and host)."""


class TrainingError(RuntimeError):
    """A failure during training, reported as one paragraph (the CLI exits with code 1)."""

    every_rank = True  # False: every rank raises the same error and rank 0 alone reports it


class CheckpointError(TrainingError):
    """Writing a checkpoint failed; the previous one is untouched."""


class CollectiveError(TrainingError):
    """A collective timed out or lost a peer; the message names the rank and the operation."""


class HealthError(CollectiveError):
    """The pre-flight health check (`distft.health`) found a rank missing, or `distft doctor` a slow one."""


class NonFiniteError(TrainingError):
    """A step's loss or gradient norm is NaN or infinite (train.on_nonfinite=stop)."""

    every_rank = False  # the loss and the norm are global: every rank stops at the same step


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
        print(f"distft {command}: error: {err}", file=sys.stderr)
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
        if debug:
            raise
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        hint = (
            f"Rerun with {DEBUG_ENV}=1 for the traceback."
            if isinstance(err, OSError)  # the disk, a permission: the message says what
            else f"This is unexpected (a bug in distft, or a fault it does not know): rerun with "
            f"{DEBUG_ENV}=1 for the traceback, and report it."
        )
        print(f"distft {command}: error: {type(err).__name__}: {text}. {hint}", file=sys.stderr)
        return EXIT_FAILURE
