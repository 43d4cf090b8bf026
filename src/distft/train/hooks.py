"""Callbacks the loop makes at fixed points of every step (and of the health check before the
first); by default they do nothing.

The entry point decides what runs there (`distft.cli` installs the test-only fault injection of
`distft.faults`); the loop only calls them. Steps are 1-based.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from distft.health import HealthHooks


def _nothing(*args: object) -> None:
    return None


@dataclass(frozen=True)
class TrainHooks:
    before_step: Callable[[int, int], None] = _nothing
    """`before_step(step, rank)`: as step `step` begins, before its batch is drawn."""
    after_backward: Callable[[nn.Module, int], None] = _nothing
    """`after_backward(model, step)`: gradients are complete, not yet clipped or applied."""
    health: HealthHooks = field(default_factory=HealthHooks)
    """Points inside the pre-flight health check (`distft.health.check`), before the first step."""
