"""Counts in what distft prints: "1 step", "2 steps", "1 process", "4 processes"."""

from __future__ import annotations

IRREGULAR = {"process": "processes", "summary": "summaries", "GPU": "GPUs", "recompile": "recompiles"}


def plural(n: int, noun: str) -> str:
    """`n` and `noun`, in the plural unless `n` is 1 (thousands separated)."""
    many = IRREGULAR.get(noun, noun + "s")
    return f"{n:,} {noun if n == 1 else many}"
