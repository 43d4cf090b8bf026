"""Every error distft reports to a user, in one place (no torch import: the CLI catches them).

Two families, told apart by when they happen and how the CLI exits:
- `ConfigError` (exit 2): a user error found before anything runs: a wrong config, an impossible
  strategy/model combination, a malformed dataset row. The message says what is wrong and how to
  fix it, in one paragraph.
- `TrainingError` (exit 1): a failure during training (a collective that timed out, a checkpoint
  that could not be written, a diverged step), reported as one paragraph, never a traceback.

`distft.exits.run_command` is where every command of the CLI ends: each of these, and anything
else that escapes (a disk error, a bug), becomes one line on stderr and an exit code.
"""


def one_line(text: object) -> str:
    """`text` as it may stand inside a one-paragraph message: a user's name or value that holds a
    line break or another control character is shown escaped, as Python writes it."""
    text = str(text)
    return text if text.isprintable() else repr(text)[1:-1]


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
