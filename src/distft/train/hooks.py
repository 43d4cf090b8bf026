"""Callbacks the loop makes at fixed points of every step (and of the health check before the
first); by default they do nothing.

The entry point decides what runs there; the loop only calls them. Steps are 1-based.
`from_environment` is the one way in from outside the process: `DISTFT_HOOKS=module:function`
names a function, importable in every rank, that returns the `TrainHooks` to install (`distft
train` and `distft doctor` read it in each rank). distft's own tests inject their faults this way
(tests/faults.py: a rank killed, hung or late, a diverged step); nothing of them ships.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from distft.errors import ConfigError
from distft.health import HealthHooks

HOOKS_VARIABLE = "DISTFT_HOOKS"


def _nothing(*args: object) -> None:
    return None


@dataclass(frozen=True)
class TrainHooks:
    before_step: Callable[[int, int], None] = _nothing
    """`before_step(step, rank)`: as step `step` begins, before its batch is drawn."""
    after_backward: Callable[[nn.Module, int], None] = _nothing
    """`after_backward(model, step)`: gradients are complete, not yet clipped or applied."""
    before_batch: Callable[[str, int, int], None] = _nothing
    """`before_batch(phase, batch, rank)`: as a batch of a phase without steps begins (0-based):
    "reference" (the reference scoring), "validation", "export" (one batch: the whole export)."""
    health: HealthHooks = field(default_factory=HealthHooks)
    """Points inside the pre-flight health check (`distft.health.check`), before the first step."""


def from_environment() -> TrainHooks | None:
    """The hooks `DISTFT_HOOKS=module:function` asks for, `module.function()`; None when unset
    (a normal run calls nothing). A name that does not resolve is a `ConfigError`."""
    spec = os.environ.get(HOOKS_VARIABLE, "")
    if not spec:
        return None
    module, _, name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:  # ValueError: an empty module name
        raise ConfigError(
            f"{HOOKS_VARIABLE}={spec!r} names no function ({err}): give module:function, the module "
            f"importable in every rank (on PYTHONPATH), or unset {HOOKS_VARIABLE}."
        ) from None
    hooks = factory()
    if hooks is not None and not isinstance(hooks, TrainHooks):
        raise ConfigError(
            f"{HOOKS_VARIABLE}={spec!r} returned {type(hooks).__name__}, not TrainHooks or None."
        )
    return hooks
