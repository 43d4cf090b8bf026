"""Failures during training, reported as one paragraph (no torch import: the CLI catches them).

`distft.config.ConfigError` is the other kind: a user error found before anything runs (exit 2).
"""


class TrainingError(RuntimeError):
    """A failure during training, reported as one paragraph (the CLI exits with code 1)."""

    every_rank = True  # False: every rank raises the same error and rank 0 alone reports it
