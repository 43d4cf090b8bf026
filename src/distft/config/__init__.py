"""Run configuration: typed dataclasses (`schema`), loaded from TOML with overrides (`io`).

This package is a leaf: it imports nothing of distft but `distft.errors`.
"""

from distft.config.choices import check_choice, nearest
from distft.config.io import apply_override, config_differences, load_config, to_dict, to_toml
from distft.config.schema import (
    DTYPES,
    METHODS,
    Config,
    DataConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    OutputConfig,
    ParallelConfig,
    TrainConfig,
    check_fields,
)

__all__ = [
    "DTYPES",
    "METHODS",
    "Config",
    "DataConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "OutputConfig",
    "ParallelConfig",
    "TrainConfig",
    "apply_override",
    "check_choice",
    "check_fields",
    "config_differences",
    "load_config",
    "nearest",
    "to_dict",
    "to_toml",
]
