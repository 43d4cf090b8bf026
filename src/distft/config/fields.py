"""Checks of a `Config` that need nothing but the config itself: choices, ranges, positive counts.

Checks that depend on a strategy or a model architecture run later, in `distft.parallel.checks`.
"""

from __future__ import annotations

import difflib
import importlib.util

from distft.config.schema import (
    ATTENTION_CHOICES,
    COMPILE_BACKENDS,
    COMPILE_CHOICES,
    DATA_FORMATS,
    DTYPES,
    FUSED_CHOICES,
    LORA_TARGET_PRESETS,
    LORA_VARIANTS,
    MASTER_WEIGHTS,
    MEASURE_COMM,
    METHODS,
    OPTIMIZERS,
    SCHEDULERS,
    TRACKERS,
    TRUNCATIONS,
    Config,
)
from distft.errors import ConfigError


def nearest(name: str, choices: list[str]) -> str:
    """ " Did you mean `x`?" for a close match, else the valid choices."""
    match = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" Did you mean `{match[0]}`?" if match else f" Valid: {', '.join(sorted(choices))}."


def check_choice(value: str, choices: tuple[str, ...] | list[str], where: str) -> None:
    if value not in choices:
        # The choices are listed once; `nearest` would list them again when nothing is close.
        match = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.5)
        hint = f" Did you mean `{match[0]}`?" if match else ""
        raise ConfigError(f"`{where}` is {value!r}; choose one of {', '.join(choices)}.{hint}")


def check_fields(cfg: Config) -> None:
    """Checks that need only the config itself; strategy and model checks: `distft.parallel.checks`."""
    check_choice(cfg.train.method, METHODS, "train.method")
    check_choice(cfg.model.dtype, DTYPES, "model.dtype")
    check_choice(cfg.model.attn_implementation, ATTENTION_CHOICES, "model.attn_implementation")
    check_choice(cfg.data.truncation, TRUNCATIONS, "data.truncation")
    check_choice(cfg.data.format, DATA_FORMATS, "data.format")
    check_choice(cfg.train.device, ("auto", "cpu", "cuda"), "train.device")
    check_choice(cfg.train.on_nonfinite, ("stop", "skip"), "train.on_nonfinite")
    check_choice(cfg.train.measure_comm, MEASURE_COMM, "train.measure_comm")
    for tracker in cfg.output.report_to:
        check_choice(tracker, TRACKERS, "output.report_to")
    check_choice(cfg.model.compile, COMPILE_CHOICES, "model.compile")
    check_choice(cfg.model.compile_backend, COMPILE_BACKENDS, "model.compile_backend")
    check_choice(cfg.optim.fused, FUSED_CHOICES, "optim.fused")
    check_choice(cfg.optim.name, OPTIMIZERS, "optim.name")
    check_choice(cfg.optim.scheduler, SCHEDULERS, "optim.scheduler")
    check_choice(cfg.lora.variant, LORA_VARIANTS, "lora.variant")
    check_choice(cfg.train.master_weights, MASTER_WEIGHTS, "train.master_weights")
    _check_targets(cfg.lora.target_modules)
    if cfg.model.attn_implementation == "flash" and importlib.util.find_spec("flash_attn") is None:
        raise ConfigError(
            "model.attn_implementation=flash needs the flash-attn package (CUDA only: `pip install "
            "flash-attn --no-build-isolation`); model.attn_implementation=auto picks it where it is "
            "installed and runs FlexAttention elsewhere."
        )
    check_choice(cfg.parallel.fsdp_wrap, ("layer", "model"), "parallel.fsdp_wrap")
    _check_counts(cfg)
    _check_ranges(cfg)
    _check_optim(cfg)


def lora_target_names(targets: list[str]) -> list[str]:
    """`lora.target_modules` as module names: a preset expanded; all-linear (peft's value: every
    linear layer but the output head) is, on Qwen3, every attention and MLP projection."""
    if targets == ["all-linear"]:
        return list(LORA_TARGET_PRESETS["all"])
    return list(LORA_TARGET_PRESETS[targets[0]]) if targets[0] in LORA_TARGET_PRESETS else list(targets)


def _check_targets(targets: list[str]) -> None:
    presets = [*LORA_TARGET_PRESETS, "all-linear"]
    named = [t for t in targets if t in presets]
    if named and len(targets) > 1:
        raise ConfigError(
            f"`lora.target_modules` {targets}: the preset {named[0]!r} stands alone; give either one "
            f"preset ({', '.join(presets)}) or a list of module names such as q_proj, v_proj."
        )


def _check_optim(cfg: Config) -> None:
    o = cfg.optim
    if not 0.0 <= o.momentum < 1.0:
        raise ConfigError(f"`optim.momentum` must be in [0, 1), got {o.momentum}.")
    if cfg.lora.lr_ratio <= 0:
        raise ConfigError(f"`lora.lr_ratio` must be positive (1: LoRA+ off), got {cfg.lora.lr_ratio}.")
    if o.tuned_global_batch_size < 0 or cfg.train.epochs < 0:
        raise ConfigError("`optim.tuned_global_batch_size` and `train.epochs` cannot be negative (0: unset).")
    if cfg.train.method == "full" and (cfg.lora.variant != "lora" or cfg.lora.lr_ratio != 1.0):
        raise ConfigError(
            f"lora.variant={cfg.lora.variant} and lora.lr_ratio={cfg.lora.lr_ratio:g} shape LoRA adapters; "
            "--method full trains no adapter. Use --method lora or qlora, or drop them."
        )


def _check_counts(cfg: Config) -> None:
    positive = {
        "lora.rank": cfg.lora.rank,
        "train.max_steps": cfg.train.max_steps,
        "train.global_batch_size": cfg.train.global_batch_size,
        "train.micro_batch_size": cfg.train.micro_batch_size,
        "train.eval_batches": cfg.train.eval_batches,
        "train.log_every": cfg.train.log_every,
        "data.max_length": cfg.data.max_length,
        "parallel.nproc": cfg.parallel.nproc,
        "parallel.nnodes": cfg.parallel.nnodes,
        "parallel.timeout_s": cfg.parallel.timeout_s,
        "parallel.health_timeout_s": cfg.parallel.health_timeout_s,
        "parallel.health_slow_s": cfg.parallel.health_slow_s,
    }
    for where, value in positive.items():
        if value <= 0:
            raise ConfigError(f"`{where}` must be positive, got {value}.")
    if cfg.output.checkpoint_every < 0 or cfg.output.keep_last < 1:
        raise ConfigError(
            "`output.checkpoint_every` cannot be negative and `output.keep_last` must be at least 1."
        )
    if cfg.optim.warmup_steps < 0 or cfg.optim.grad_clip < 0 or cfg.train.eval_every < 0:
        raise ConfigError(
            "`optim.warmup_steps`, `optim.grad_clip` and `train.eval_every` cannot be negative."
        )
    if cfg.train.straggler_ratio <= 1:
        raise ConfigError(f"`train.straggler_ratio` must be above 1, got {cfg.train.straggler_ratio}.")
    if cfg.train.straggler_window < 0:
        raise ConfigError(
            f"`train.straggler_window` cannot be negative (0: off), got {cfg.train.straggler_window}."
        )
    if cfg.data.streaming and not cfg.data.cache:  # a stream held in every rank's memory defeats it
        raise ConfigError("data.streaming=true streams into the token cache: it needs data.cache=true.")
    if cfg.parallel.max_restarts < 0:
        raise ConfigError(f"`parallel.max_restarts` cannot be negative, got {cfg.parallel.max_restarts}.")
    if cfg.train.method == "qlora":
        if cfg.model.quant_block_size <= 0 or cfg.model.quant_block_size % 2:
            raise ConfigError(
                f"`model.quant_block_size` must be a positive even number, got {cfg.model.quant_block_size}."
            )
        if cfg.model.quant_scaler_block_size <= 0:
            raise ConfigError(
                f"`model.quant_scaler_block_size` must be positive, got {cfg.model.quant_scaler_block_size}."
            )


def _check_ranges(cfg: Config) -> None:
    if not 0.0 <= cfg.lora.dropout < 1.0:
        raise ConfigError(f"`lora.dropout` must be in [0, 1), got {cfg.lora.dropout}.")
    if cfg.lora.alpha <= 0:
        raise ConfigError(f"`lora.alpha` must be positive, got {cfg.lora.alpha}.")
    if not cfg.lora.target_modules:
        raise ConfigError("`lora.target_modules` is empty: name at least one projection, e.g. q_proj.")
    if cfg.optim.lr <= 0:
        raise ConfigError(f"`optim.lr` must be positive, got {cfg.optim.lr}.")
    if not 0.0 <= cfg.optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"`optim.min_lr_ratio` must be in [0, 1], got {cfg.optim.min_lr_ratio}.")
    if not 0.0 < cfg.data.validation_fraction < 1.0:
        raise ConfigError(
            f"`data.validation_fraction` must be in (0, 1), got {cfg.data.validation_fraction}."
        )
    if not 0 <= cfg.parallel.node_rank < cfg.parallel.nnodes:
        raise ConfigError(
            f"`parallel.node_rank` is {cfg.parallel.node_rank} but there are {cfg.parallel.nnodes} nodes "
            f"(ranks 0..{cfg.parallel.nnodes - 1})."
        )
