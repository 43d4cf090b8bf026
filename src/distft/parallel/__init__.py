"""Parallel strategies: each wraps the model and runs a step; the loop never asks which one runs.

`registry.STRATEGIES` names them all; `base.Strategy` is the seam between a strategy and the loop;
`checks` validates a config and a model against a strategy before launch (with the rules of
`distft.layout.rules`); `grads` and `dims` are shared by the strategies (one norm-and-clip, one
flat all-reduce; the device mesh of a `distft.layout.ParallelDims`).
"""

from distft.layout.rules import ignored_settings, master_weights
from distft.parallel.base import Batch, Strategy
from distft.parallel.checks import BatchShape, batch_shape, check_config, check_model
from distft.parallel.registry import STRATEGIES

__all__ = [
    "STRATEGIES",
    "Batch",
    "BatchShape",
    "Strategy",
    "batch_shape",
    "check_config",
    "check_model",
    "ignored_settings",
    "master_weights",
]
