"""Checks of a `Config` that need nothing but the config itself: choices, and the range of every
numeric setting (`RANGES`, one table), then the few relations between settings.

Checks that depend on a strategy or a model architecture run later, in `distft.parallel.checks`.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

from distft.config.choices import (
    ATTENTION_CHOICES,
    CHECKPOINTING,
    CHECKPOINTING_ALIASES,
    COMPILE_BACKENDS,
    COMPILE_CHOICES,
    CP_METHODS,
    DATA_FORMATS,
    DPO_LOSSES,
    DTYPES,
    EXPERTS_CHOICES,
    FP8_CHOICES,
    FUSED_CHOICES,
    LORA_TARGET_PRESETS,
    LORA_VARIANTS,
    MASTER_WEIGHTS,
    MEASURE_COMM,
    METHODS,
    OBJECTIVES,
    OPTIMIZERS,
    PIPELINE_SCHEDULES,
    ROLES,
    ROPE_SCALINGS,
    SCHEDULERS,
    TRACKERS,
    TRUNCATIONS,
    check_choice,
    nearest,
)
from distft.config.schema import Config, DataConfig
from distft.errors import ConfigError, one_line


def check_fields(cfg: Config) -> None:
    """Checks that need only the config itself; strategy and model checks: `distft.parallel.checks`."""
    check_choice(cfg.train.method, METHODS, "train.method")
    check_choice(cfg.train.objective, OBJECTIVES, "train.objective")
    check_choice(cfg.dpo.loss_type, DPO_LOSSES, "dpo.loss_type")
    check_choice(cfg.model.dtype, DTYPES, "model.dtype")
    check_choice(cfg.model.attn_implementation, ATTENTION_CHOICES, "model.attn_implementation")
    check_choice(cfg.model.experts_implementation, EXPERTS_CHOICES, "model.experts_implementation")
    checkpointing = cfg.model.activation_checkpointing
    cfg.model.activation_checkpointing = CHECKPOINTING_ALIASES.get(checkpointing, checkpointing)
    check_choice(cfg.model.activation_checkpointing, CHECKPOINTING, "model.activation_checkpointing")
    check_choice(cfg.model.rope_scaling, ROPE_SCALINGS, "model.rope_scaling")
    check_choice(cfg.parallel.cp_method, CP_METHODS, "parallel.cp_method")
    check_choice(cfg.data.truncation, TRUNCATIONS, "data.truncation")
    check_choice(cfg.data.format, DATA_FORMATS, "data.format")
    _check_data(cfg.data)
    check_choice(cfg.train.device, ("auto", "cpu", "cuda"), "train.device")
    check_choice(cfg.train.on_nonfinite, ("stop", "skip"), "train.on_nonfinite")
    check_choice(cfg.train.measure_comm, MEASURE_COMM, "train.measure_comm")
    for tracker in cfg.output.report_to:
        check_choice(tracker, TRACKERS, "output.report_to")
    check_choice(cfg.model.compile, COMPILE_CHOICES, "model.compile")
    check_choice(cfg.model.compile_backend, COMPILE_BACKENDS, "model.compile_backend")
    check_choice(cfg.model.fp8, FP8_CHOICES, "model.fp8")
    check_choice(cfg.optim.fused, FUSED_CHOICES, "optim.fused")
    check_choice(cfg.optim.name, OPTIMIZERS, "optim.name")
    check_choice(cfg.optim.scheduler, SCHEDULERS, "optim.scheduler")
    check_choice(cfg.lora.variant, LORA_VARIANTS, "lora.variant")
    check_choice(cfg.train.master_weights, MASTER_WEIGHTS, "train.master_weights")
    _check_targets(cfg.lora.target_modules)
    if blank := [token for token in cfg.model.added_tokens if not token.strip()]:
        raise ConfigError(
            f"model.added_tokens holds {blank[0]!r}: an added token needs text, e.g. <|speaker|>."
        )
    if cfg.model.attn_implementation == "flash" and importlib.util.find_spec("flash_attn") is None:
        raise ConfigError(
            "model.attn_implementation=flash needs the flash-attn package (CUDA only: `pip install "
            "flash-attn --no-build-isolation`); model.attn_implementation=auto picks it where it is "
            "installed and runs FlexAttention elsewhere."
        )
    # Values no strategy accepts are refused whatever the strategy (one that ignores them says so).
    check_choice(cfg.parallel.fsdp_wrap, ("layer", "model"), "parallel.fsdp_wrap")
    check_choice(cfg.parallel.schedule, PIPELINE_SCHEDULES, "parallel.schedule")
    for key in ("fsdp_param_dtype", "fsdp_reduce_dtype", "fsdp_output_dtype"):
        if value := getattr(cfg.parallel, key):
            check_choice(value, DTYPES, f"parallel.{key}")
    _check_pp_split(cfg.parallel.pp_split)
    check_ranges(cfg)
    _check_relations(cfg)
    _check_optim(cfg)


def lora_target_names(targets: list[str]) -> list[str]:
    """`lora.target_modules` as module names: a preset expanded; all-linear (peft's value: every
    linear layer but the output head) is, on Qwen3, every attention and MLP projection."""
    if targets == ["all-linear"]:
        return list(LORA_TARGET_PRESETS["all"])
    return list(LORA_TARGET_PRESETS[targets[0]]) if targets[0] in LORA_TARGET_PRESETS else list(targets)


SOURCE_KEYS = ("source", "weight", "format")  # a [[data.sources]] table


def _check_data(data: DataConfig) -> None:
    """data.roles maps onto the chat roles; data.sources: tables of a source, a positive weight and
    a format, and not beside a data.source of its own."""
    for name, role in data.roles.items():
        if role not in ROLES:
            raise ConfigError(
                f"`data.roles.{one_line(name)}` is {role!r}; map it to one of {', '.join(ROLES)}."
            )
    if data.sources and data.source != "sample":
        raise ConfigError(
            f"data.source={data.source!r} and data.sources both name the training rows: keep one "
            "(data.sources mixes several datasets by weight; data.source, or --data, names one)."
        )
    for i, entry in enumerate(data.sources):
        where = f"data.sources[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f'`{where}` must be a table: source = "rows.jsonl", weight = 1.0.')
        for key in entry:
            if key not in SOURCE_KEYS:
                raise ConfigError(
                    f"Unknown key `{where}.{one_line(str(key))}`.{nearest(str(key), list(SOURCE_KEYS))}"
                )
        if not isinstance(entry.get("source"), str) or not entry["source"]:
            raise ConfigError(
                f"`{where}` needs a `source`: a local .jsonl/.parquet/.csv file, a hub id or sample."
            )
        weight = entry.get("weight", 1.0)
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not math.isfinite(weight)
            or weight <= 0
        ):
            raise ConfigError(f"`{where}.weight` must be a positive number, got {weight!r:.40} (range: > 0).")
        check_choice(str(entry.get("format", data.format)), DATA_FORMATS, f"{where}.format")


def _check_targets(targets: list[str]) -> None:
    presets = [*LORA_TARGET_PRESETS, "all-linear"]
    named = [t for t in targets if t in presets]
    if named and len(targets) > 1:
        raise ConfigError(
            f"`lora.target_modules` {targets}: the preset {named[0]!r} stands alone; give either one "
            f"preset ({', '.join(presets)}) or a list of module names such as q_proj, v_proj."
        )


def _check_pp_split(split: str | list[int]) -> None:
    """balanced, even, or layers per stage, each at least one (their count and sum need the pipeline
    and the model: `distft.parallel.pipeline.layout.cut_layers`)."""
    if isinstance(split, str):
        if split not in ("balanced", "even"):
            raise ConfigError(
                f"`parallel.pp_split` is {split!r}; choose balanced, even, or a list of decoder layers per "
                "stage such as [5, 3] (parallel.pp_split=[5,3])."
            )
    elif not split or min(split) < 1:
        raise ConfigError(
            f"`parallel.pp_split` is {split}: every pipeline stage needs at least one decoder layer."
        )


def _check_optim(cfg: Config) -> None:
    if cfg.train.method == "full" and (cfg.lora.variant != "lora" or cfg.lora.lr_ratio != 1.0):
        raise ConfigError(
            f"lora.variant={cfg.lora.variant} and lora.lr_ratio={cfg.lora.lr_ratio:g} shape LoRA adapters; "
            "--method full trains no adapter. Use --method lora or qlora, or drop them."
        )


# ---- Ranges ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Range:
    """The values a numeric setting may take: from `low` (excluded when `low_open`) up to `high`
    (excluded when `high_open`; None: no bound but int64's). A float must also be finite."""

    low: float
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        # Written as what must hold, so NaN (false in every comparison) is out of every range.
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = self.low < value if self.low_open else self.low <= value
        top = INT64_MAX if self.high is None else self.high
        below = value < top if self.high_open else value <= top
        return above and below

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        low, high = _number(self.low), _number(self.high)
        return f"{'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


INT64_MAX = 2**63 - 1  # the largest count or seed torch (and TOML) holds
POSITIVE, COUNT, NON_NEGATIVE = Range(0, low_open=True), Range(1), Range(0)
FRACTION = Range(0, 1, high_open=True)  # [0, 1)
YEAR_S = Range(1, 365 * 24 * 3600)  # a timeout: a second to a year (timedelta overflows beyond)
SEED = Range(0, 2**32 - 1)  # the data order seeds torch with seed x 100003 + epoch, in 63 bits

# Every int and float setting of `distft.config.schema`, checked by `check_ranges` when a config
# is loaded (tests/config/test_ranges.py holds this table to the schema and to docs/reliability.md).
RANGES: dict[str, Range] = {
    "model.seed": SEED,
    "model.quant_block_size": Range(2),  # and even, under train.method=qlora
    "model.quant_scaler_block_size": COUNT,
    "model.mlp_tiles": NON_NEGATIVE,  # 0, 1: the MLP whole
    "model.rope_factor": NON_NEGATIVE,  # 0: unset; > 1 with model.rope_scaling (`distft.model.positions`)
    "data.validation_fraction": Range(0, 1, low_open=True, high_open=True),
    "data.max_length": Range(32),  # the chat template alone takes ~10-35 tokens
    "data.max_rows": NON_NEGATIVE,
    "lora.rank": COUNT,
    "lora.alpha": POSITIVE,
    "lora.dropout": FRACTION,
    "lora.lr_ratio": POSITIVE,  # 1: LoRA+ off
    "dpo.beta": POSITIVE,
    "dpo.label_smoothing": Range(0, 0.5, high_open=True),
    "dpo.desirable_weight": POSITIVE,
    "dpo.undesirable_weight": POSITIVE,
    "dpo.max_prompt_length": NON_NEGATIVE,  # 0: no limit
    "dpo.max_completion_length": NON_NEGATIVE,
    "moe.aux_loss_coef": NON_NEGATIVE,  # 0: recorded, not added
    "moe.z_loss_coef": NON_NEGATIVE,
    "optim.lr": POSITIVE,
    "optim.weight_decay": NON_NEGATIVE,
    "optim.beta1": FRACTION,
    "optim.beta2": FRACTION,
    "optim.eps": POSITIVE,
    "optim.warmup_steps": NON_NEGATIVE,
    "optim.warmup_ratio": FRACTION,  # 0: unset
    "optim.min_lr_ratio": Range(0, 1),
    "optim.grad_clip": NON_NEGATIVE,  # 0: no clipping
    "optim.momentum": FRACTION,
    "optim.tuned_global_batch_size": NON_NEGATIVE,  # 0: unset
    "train.max_steps": COUNT,
    "train.epochs": NON_NEGATIVE,  # 0: train.max_steps counts instead
    "train.global_batch_size": COUNT,
    "train.micro_batch_size": COUNT,
    "train.eval_every": NON_NEGATIVE,
    "train.eval_batches": NON_NEGATIVE,
    "train.log_every": COUNT,
    "train.seed": SEED,
    "train.straggler_window": NON_NEGATIVE,  # 0: no straggler monitor
    "train.straggler_ratio": Range(1, low_open=True),
    "train.early_stopping_patience": NON_NEGATIVE,  # 0: off
    "train.early_stopping_delta": NON_NEGATIVE,
    "parallel.nproc": COUNT,
    "parallel.nnodes": COUNT,
    "parallel.node_rank": NON_NEGATIVE,  # and below parallel.nnodes
    "parallel.timeout_s": YEAR_S,
    "parallel.health_timeout_s": YEAR_S,
    "parallel.health_slow_s": POSITIVE,
    "parallel.max_restarts": NON_NEGATIVE,
    "parallel.ddp_bucket_mb": Range(0, 1e6, low_open=True),  # up to a terabyte: DDP takes it in bytes
    "parallel.fsdp_prefetch": NON_NEGATIVE,
    "parallel.microbatches": NON_NEGATIVE,  # 0: from train.micro_batch_size
    "parallel.stages_per_rank": NON_NEGATIVE,  # 0: the schedule's default
    "parallel.dp": NON_NEGATIVE,  # 0: the world size / (tp x pp x cp)
    "parallel.tp": COUNT,
    "parallel.pp": COUNT,
    "parallel.cp": NON_NEGATIVE,  # 0: the world size / dp
    "parallel.shard": NON_NEGATIVE,  # 0: --nproc
    "parallel.ep": NON_NEGATIVE,  # 0: every process
    "output.checkpoint_every": NON_NEGATIVE,  # 0: never
    "output.keep_last": COUNT,
}


def range_error(where: str, value: float, allowed: Range) -> str:
    """The one-line refusal of `value` for setting `where`: which bound it breaks, and the range."""
    low, high = allowed.low, INT64_MAX if allowed.high is None else allowed.high
    if isinstance(value, float) and not math.isfinite(value):
        rule = "must be a finite number"
    elif value > high or (allowed.high_open and value == high):
        rule = f"must be {'below' if allowed.high_open else 'at most'} {_number(high)}"
        rule += " (2**63 - 1)" if allowed.high is None else ""
    elif low == 0 and not allowed.low_open:
        rule = "cannot be negative"
    elif (low, allowed.low_open) in ((0, True), (1, False)):
        rule = "must be positive"
    else:
        rule = f"must be {'above' if allowed.low_open else 'at least'} {_number(low)}"
    return f"`{where}` {rule}, got {value!r} (range: {allowed})."


def check_ranges(cfg: Config) -> None:
    """Every numeric setting within its range (`RANGES`); NaN and infinities are out of all of them."""
    for where, allowed in RANGES.items():
        section, key = where.split(".")
        value = getattr(getattr(cfg, section), key)
        if value not in allowed:
            raise ConfigError(range_error(where, value, allowed))


def _check_relations(cfg: Config) -> None:
    """What a range cannot say: a setting that depends on another."""
    if cfg.train.early_stopping_patience and not (cfg.train.eval_every and cfg.train.eval_batches):
        raise ConfigError(
            f"train.early_stopping_patience={cfg.train.early_stopping_patience} counts validations, and this "
            f"run validates {'never' if not cfg.train.eval_batches else 'only at the end'} (train.eval_every="
            f"{cfg.train.eval_every}, train.eval_batches={cfg.train.eval_batches}): set both above 0, or "
            "train.early_stopping_patience=0."
        )
    if not cfg.lora.target_modules:
        raise ConfigError("`lora.target_modules` is empty: name at least one projection, e.g. q_proj.")
    if cfg.data.streaming and not cfg.data.cache:  # a stream held in every rank's memory defeats it
        raise ConfigError("data.streaming=true streams into the token cache: it needs data.cache=true.")
    if cfg.train.method == "qlora" and cfg.model.quant_block_size % 2:
        raise ConfigError(
            f"`model.quant_block_size` must be a positive even number, got {cfg.model.quant_block_size}."
        )
    if cfg.model.rope_scaling != "none" and not cfg.model.rope_factor > 1:
        raise ConfigError(
            f"model.rope_scaling={cfg.model.rope_scaling} needs model.rope_factor > 1, the factor the "
            "pretrained positions are multiplied by (e.g. 4: Qwen3's 32,768 -> 131,072)."
        )
    if cfg.model.rope_scaling == "none" and cfg.model.rope_factor:
        raise ConfigError(
            f"model.rope_factor={cfg.model.rope_factor:g} does nothing without model.rope_scaling "
            "(yarn, linear or dynamic)."
        )
    if cfg.parallel.node_rank >= cfg.parallel.nnodes:
        raise ConfigError(
            f"`parallel.node_rank` is {cfg.parallel.node_rank} but there are {cfg.parallel.nnodes} nodes "
            f"(ranks 0..{cfg.parallel.nnodes - 1})."
        )
