"""What distft prints: counts ("1 step", "2 steps", "1 process", "4 processes"), and the console
its tables and lines go to."""

from __future__ import annotations

import sys

from rich.console import Console

# Columns of output that is not a terminal (a log file, a pipe): rich's default there is 80, which
# wraps a table's cells and the header's lines.
FILE_WIDTH = 120

IRREGULAR = {"process": "processes", "summary": "summaries", "GPU": "GPUs", "recompile": "recompiles"}


def plural(n: int, noun: str) -> str:
    """`n` and `noun`, in the plural unless `n` is 1 (thousands separated)."""
    many = IRREGULAR.get(noun, noun + "s")
    return f"{n:,} {noun if n == 1 else many}"


def console(**options) -> Console:
    """A console for a command's output: the terminal's width, or `FILE_WIDTH` columns in a file."""
    return Console(highlight=False, width=None if sys.stdout.isatty() else FILE_WIDTH, **options)
