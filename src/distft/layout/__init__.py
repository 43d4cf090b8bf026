"""A run's layout, described once and read by everyone: the runtime (`distft.parallel`), the
planner (`distft.plan`), bench and the CLI's checks before launch.

- `dims.ParallelDims`: the degree along each of six mesh dimensions (`dp_replicate`, `dp_shard`,
  `cp`, `tp`, `pp`, `ep`), validated when built, read from a config and written back to one;
- `spec.StrategySpec` and `strategies.SPECS`: what each strategy is (the dimensions it spans,
  what it shards, what each rank holds and moves, what it can run and why not).

Imports neither torch nor the planner: the CLI reads it before deciding to import either.
"""

from distft.layout.dims import ParallelDims
from distft.layout.spec import DIMS, FEATURES, WORLD_DIMS, StrategySpec
from distft.layout.strategies import SPECS, takers

__all__ = ["DIMS", "FEATURES", "SPECS", "WORLD_DIMS", "ParallelDims", "StrategySpec", "takers"]
