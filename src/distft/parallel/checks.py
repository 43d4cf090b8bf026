"""Checks before launch that need the strategy classes, and the batch shape they derive.

`distft.config` checks each field on its own and `distft.layout.rules` a config against the
strategy's spec; here a config is checked against the strategy's own `validate_config` (the
settings only it reads) and the global batch must split into whole micro-batches on every
data-parallel rank; once the architecture is known, `check_model` checks the model (heads and MLP
divisible by the TP degree, layers enough for the pipeline stages, NF4 blocks that shard, a family
distft trains). The CLI runs both before any process is launched; `train` runs them again in
every rank, where they are cheap and pure: nothing here changes the config.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from distft.config import Config, check_choice
from distft.errors import ConfigError
from distft.layout import SPECS
from distft.layout.rules import check_moe, check_rules
from distft.model.build import check_target_modules
from distft.model.families import check_sequence_length, family_of
from distft.model.positions import check_positions
from distft.model.tokens import check_modules_to_save
from distft.parallel.registry import STRATEGIES


@dataclass(frozen=True)
class BatchShape:
    """How one optimizer step's global batch is cut: per rank, per forward/backward."""

    micro_batch_size: int  # sequences per forward/backward on one rank
    data_parallel_size: int  # ranks reading distinct data
    accumulation_steps: int  # micro-batches per rank per optimizer step


def check_config(cfg: Config) -> BatchShape:
    """ConfigError for a strategy that cannot run this config; else how the batch is cut."""
    check_choice(cfg.parallel.strategy, sorted(SPECS), "parallel.strategy")
    check_rules(cfg, SPECS[cfg.parallel.strategy])
    STRATEGIES[cfg.parallel.strategy].validate_config(cfg)
    return batch_shape(cfg)


def check_model(cfg: Config, model_config: PretrainedConfig) -> None:
    """ConfigError when the architecture cannot be split the way the strategy splits it, or lacks
    a layer `lora.target_modules` names, or is of a family distft does not train."""
    if family_of(model_config, cfg.model.name).moe:
        check_moe(cfg, SPECS[cfg.parallel.strategy])
    check_sequence_length(model_config, cfg.model.name, cfg.data.max_length)
    check_positions(model_config, cfg.model.name, cfg.data.max_length)
    check_target_modules(cfg, model_config)
    check_modules_to_save(cfg, model_config)
    STRATEGIES[cfg.parallel.strategy].validate_model(cfg, model_config)


def batch_shape(cfg: Config) -> BatchShape:
    strategy = STRATEGIES[cfg.parallel.strategy]
    dp, micro = strategy.data_parallel_size(cfg), strategy.micro_batch_size(cfg)
    per_step = micro * dp
    if cfg.train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size ({cfg.train.global_batch_size}) must be a multiple of "
            f"train.micro_batch_size x data-parallel ranks ({micro} x {dp} = {per_step}), "
            "so every rank runs the same number of whole micro-batches."
        )
    return BatchShape(micro, dp, cfg.train.global_batch_size // per_step)
