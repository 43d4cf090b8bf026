"""Run configuration: typed dataclasses (`schema`), loaded from TOML with overrides (`io`).

This package is a leaf: it imports nothing of distft but layer 0 (`distft.errors`, `distft.textfiles`).
"""

from distft.config.choices import DTYPES, METHODS, PROJECTION_NAMES
from distft.config.fields import RANGES, Range, check_choice, check_fields, lora_target_names, nearest
from distft.config.io import apply_override, config_differences, load_config, to_toml
from distft.config.schema import (
    Config,
    DataConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    OutputConfig,
    ParallelConfig,
    TrainConfig,
)

__all__ = [
    "DTYPES",
    "METHODS",
    "PROJECTION_NAMES",
    "RANGES",
    "Config",
    "DataConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "OutputConfig",
    "ParallelConfig",
    "Range",
    "TrainConfig",
    "apply_override",
    "check_choice",
    "check_fields",
    "config_differences",
    "load_config",
    "lora_target_names",
    "nearest",
    "to_toml",
]
