"""Single device: the reference every other strategy is proven equal to.

Nothing is sharded and no collective runs: one process holds the whole model, its gradients and
the optimizer state, and runs every micro-batch of the global batch itself, accumulating
gradients before one optimizer step.
"""

from __future__ import annotations

from distft.config import Config
from distft.errors import ConfigError
from distft.parallel.base import Strategy


class Single(Strategy):
    name = "single"

    @classmethod
    def validate_config(cls, cfg: Config) -> None:
        if cfg.world_size != 1:
            raise ConfigError(
                f"--strategy single runs one process, but --nproc x --nnodes is {cfg.world_size}. "
                "Pick a multi-process strategy (ddp, fsdp, ...) or drop --nproc."
            )
