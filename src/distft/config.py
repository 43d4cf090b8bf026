"""Run configuration: plain dataclasses, loaded from TOML, overridden by `section.key=value`.

A run is fully described by one `Config`. It is built in three layers, later ones winning:
the dataclass defaults (the embedded CPU default), an optional TOML file, and command-line
overrides. The resolved config is written to `DIR/config.toml`, so `distft train --config
DIR/config.toml` reproduces a run.

Every error a user can make here is raised as `ConfigError` with a one-paragraph message
(the CLI prints it and exits with code 2): malformed TOML with its line and column, unknown
keys with the nearest valid one, wrong types, and values out of range.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from distft.errors import ConfigError

# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    name: str = "tiny"
    """A preset name (`distft.model.PRESETS`), a local directory (config.json + safetensors) or a hub id."""
    dtype: str = "float32"
    """Weight dtype: float32 or bfloat16. Adapters are trained in this dtype too."""
    autocast: bool = True
    """bf16 autocast for forward/backward where the device supports it (CUDA only; a no-op on CPU)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward instead of storing its activations."""
    attn_implementation: str = "sdpa"
    """Attention kernel passed to transformers: sdpa or eager."""
    seed: int = 0
    """Seed of the random initialisation of preset models."""
    quant_block_size: int = 64
    """QLoRA: weights per NF4 block; each block is scaled by its absmax."""
    quant_scaler_block_size: int = 256
    """QLoRA double quantization: blocks whose 8-bit absmaxes share one scale (capped to a weight's
    block count; under FSDP each rank must hold whole groups, checked before launch)."""
    double_quant: bool = True
    """QLoRA: store the block absmaxes in 8 bits (double quantization); false: in the model dtype."""


@dataclass
class DataConfig:
    source: str = "sample"
    """`sample` (bundled meetings), a local .jsonl/.parquet file, or a hub dataset id."""
    transcript_field: str = ""
    """Field holding the transcript; empty: detected from the known AMI schemas."""
    summary_field: str = ""
    """Field holding the reference summary; empty: detected from the known AMI schemas."""
    train_split: str = "train"
    """Split used for training (hub datasets)."""
    validation_split: str = "validation"
    """Split used for evaluation; a local file is split by `validation_fraction` instead."""
    validation_fraction: float = 0.1
    """Fraction of a single local file held out for validation."""
    max_length: int = 768
    """Tokens per example: prompt + transcript + summary. Longer transcripts are truncated."""
    truncation: str = "middle"
    """How an over-long transcript is cut: head (keep its start), tail (keep its end) or middle
    (keep both ends, drop the middle). The summary is never truncated."""
    system_prompt: str = "You are a helpful assistant that summarizes meeting transcripts."
    """System message of the chat prompt; empty for none."""
    instruction: str = "Summarize the following meeting transcript."
    """User instruction placed before the transcript."""
    max_rows: int = 0
    """Use at most this many training rows (0: all)."""


@dataclass
class LoraConfig:
    rank: int = 16
    """LoRA rank r."""
    alpha: float = 32.0
    """LoRA scaling numerator: updates are scaled by alpha / r."""
    dropout: float = 0.0
    """Dropout on the LoRA input (0 keeps runs exactly reproducible across strategies)."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Projections that get adapters: all attention and MLP projections by default."""


@dataclass
class OptimConfig:
    lr: float = 1e-2
    """Peak learning rate (AdamW). The default suits the randomly initialised CPU presets; real
    checkpoints want ~1e-4 to 2e-4 (configs/qwen3-4b-lora.toml)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    warmup_steps: int = 10
    """Linear warm-up from 0 to `lr`."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio on the last step."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""


@dataclass
class TrainConfig:
    method: str = "lora"
    """lora (adapters on a frozen base), qlora (adapters on a frozen 4-bit NF4 base, `distft.quant`)
    or full (every weight trains)."""
    max_steps: int = 100
    """Optimizer steps."""
    global_batch_size: int = 8
    """Sequences per optimizer step, summed over all data-parallel ranks and accumulation steps."""
    micro_batch_size: int = 4
    """Sequences per forward/backward on one rank."""
    eval_every: int = 25
    """Validation loss every N steps (0: only at the end)."""
    eval_batches: int = 4
    """Validation micro-batches per evaluation."""
    log_every: int = 1
    """Write a metrics line every N steps."""
    seed: int = 0
    """Seed for data order and dropout."""
    device: str = "auto"
    """auto (CUDA when present, else CPU), cpu or cuda."""
    on_nonfinite: str = "stop"
    """A step whose loss or gradient norm is NaN/inf: `stop` (before the optimizer step, so the
    weights and the last checkpoint stay good) or `skip` (no update; the run goes on)."""


@dataclass
class ParallelConfig:
    strategy: str = "single"
    """single, or a multi-process strategy from `distft.parallel.STRATEGIES`."""
    nproc: int = 1
    """Processes per node; above 1, `distft train` launches itself through torchrun."""
    nnodes: int = 1
    """Nodes taking part (each runs `distft train` with its own --node-rank)."""
    node_rank: int = 0
    rdzv_endpoint: str = "127.0.0.1:29500"
    """HOST:PORT of the rendezvous for multi-node runs."""
    timeout_s: int = 600
    """A collective that waits longer than this fails instead of hanging."""
    max_restarts: int = 0
    """torchrun's elastic agent restarts every rank this many times after one fails (a killed
    rank, a lost peer); each restart resumes from the latest checkpoint."""
    ddp_bucket_mb: float = 25.0
    """DDP: gradients are all-reduced in buckets of this size, overlapping backward."""
    ddp_gradient_as_bucket_view: bool = True
    """DDP: gradients live inside the communication buckets (one copy fewer)."""
    ddp_static_graph: bool = False
    """DDP: declare the autograd graph identical every step (lets DDP skip per-step bookkeeping)."""
    fsdp_param_dtype: str = ""
    """FSDP: dtype parameters are all-gathered and computed in; empty: the model dtype."""
    fsdp_reduce_dtype: str = ""
    """FSDP: dtype gradients are reduce-scattered in; empty: the param dtype. float32 is safest."""
    fsdp_output_dtype: str = ""
    """FSDP: dtype the root module's outputs are cast to; empty: leave them as computed."""
    fsdp_cpu_offload: bool = False
    """FSDP: keep sharded parameters, gradients and optimizer state in CPU memory (CUDA runs)."""
    fsdp_prefetch: int = 1
    """FSDP: decoder layers whose all-gather is issued ahead of use, forward and backward (0: none)."""
    sequence_parallel: bool = True
    """tp-sp: split the residual stream, norms and loss along the sequence; false: plain Megatron TP."""
    schedule: str = "1f1b"
    """pp: gpipe, 1f1b, interleaved-1f1b, zero-bubble (interleaved ZB-H1) or zbv (zero bubble, V-shaped)."""
    microbatches: int = 0
    """pp: micro-batches the global batch (ddp+pp: a replica's share) is cut into per step (m); sets
    train.micro_batch_size to global_batch_size / m. 0: keep train.micro_batch_size (m = global_batch_size / micro_batch_size)."""
    stages_per_rank: int = 0
    """pp: virtual stages per rank (V). 0: 2 for interleaved-1f1b and zbv, 1 for the others."""
    dp: int = 0
    """2D strategies (fsdp+tp, ddp+pp): data-parallel degree; 0: world size / (tp x pp)."""
    tp: int = 1
    """2D strategies (fsdp+tp): tensor-parallel degree, the inner (fastest-varying) mesh dimension."""
    pp: int = 1
    """ddp+pp: pipeline degree (ranks per pipeline replica), the outermost mesh dimension; 1 elsewhere.
    parallel.schedule, microbatches and stages_per_rank apply to each replica's pipeline, whose
    micro-batches cut global_batch_size / dp sequences."""


@dataclass
class OutputConfig:
    dir: str = "runs/default"
    """Run directory: adapter/, metrics.jsonl, config.toml."""
    save_base: bool = True
    """Save a randomly initialised preset base next to the adapter, so the adapter can be loaded."""
    checkpoint_every: int = 0
    """Write a resumable training-state checkpoint every N steps (0: never)."""
    keep_last: int = 2
    """Checkpoints kept; older ones are deleted once a newer one is complete."""
    resume: bool = True
    """Continue from the latest checkpoint in `dir` if there is one."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    @property
    def world_size(self) -> int:
        return self.parallel.nproc * self.parallel.nnodes


_SECTION_TYPES = typing.get_type_hints(Config)


# ---------------------------------------------------------------------------------------------
# Loading and overriding
# ---------------------------------------------------------------------------------------------


def _nearest(name: str, choices: list[str]) -> str:
    match = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" Did you mean `{match[0]}`?" if match else f" Valid: {', '.join(sorted(choices))}."


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check `value` against a field's type annotation, converting only lossless cases."""
    origin = typing.get_origin(annotation)
    if origin in (list, typing.List):  # noqa: UP006
        (item_type,) = typing.get_args(annotation)
        if isinstance(value, str):  # "a,b,c" on the command line
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"`{where}` must be a list, got {value!r}.")
        return [_coerce(v, item_type, where) for v in value]
    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"union types are not supported in config ({where})")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"`{where}` must be true or false, got {value!r}.")
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ConfigError(f"`{where}` must be an integer, got {value!r}.")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"`{where}` must be an integer, got {value!r}.") from None
    if annotation is float:
        if isinstance(value, bool):
            raise ConfigError(f"`{where}` must be a number, got {value!r}.")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"`{where}` must be a number, got {value!r}.") from None
    if annotation is str:
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise ConfigError(f"`{where}` must be a string, got {value!r}.")
        return str(value)
    raise TypeError(f"unsupported config type {annotation} ({where})")


def _apply(cfg: Config, section: str, key: str, value: Any) -> None:
    if section not in _SECTION_TYPES:
        raise ConfigError(f"Unknown config section `{section}`.{_nearest(section, list(_SECTION_TYPES))}")
    section_obj = getattr(cfg, section)
    hints = typing.get_type_hints(type(section_obj))
    if key not in hints:
        raise ConfigError(f"Unknown config key `{section}.{key}`.{_nearest(key, list(hints))}")
    setattr(section_obj, key, _coerce(value, hints[key], f"{section}.{key}"))


def _parse_toml(text: str, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        # tomllib's message already carries "(at line L, column C)".
        raise ConfigError(f"{source} is not valid TOML: {err}.") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the TOML file at `path`, then `section.key=value` overrides; validated."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"Config file {path} does not exist.")
        data = _parse_toml(path.read_text(encoding="utf-8"), str(path))
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(
                    f"{path}: top-level key `{section}` must be a [section] table."
                    f"{_nearest(section, list(_SECTION_TYPES))}"
                )
            for key, value in table.items():
                _apply(cfg, section, key, value)
    for item in overrides or []:
        apply_override(cfg, item)
    validate(cfg)
    return cfg


def apply_override(cfg: Config, item: str) -> None:
    """Apply one `section.key=value`; the value is read as a TOML value when it parses as one."""
    dotted, sep, raw = item.partition("=")
    section, dot, key = dotted.strip().partition(".")
    if not sep or not dot or not key:
        raise ConfigError(f"Override `{item}` must look like section.key=value, e.g. optim.lr=1e-4.")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare string such as train.method=full
    _apply(cfg, section, key, value)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

METHODS = ("lora", "qlora", "full")
DTYPES = ("float32", "bfloat16")
TRUNCATIONS = ("head", "tail", "middle")


def _choice(value: str, choices: tuple[str, ...] | list[str], where: str) -> None:
    if value not in choices:
        raise ConfigError(
            f"`{where}` is {value!r}; choose one of {', '.join(choices)}.{_nearest(value, list(choices))}"
        )


def validate(cfg: Config) -> None:
    """Checks that need only the config; model- and strategy-specific checks live with them."""
    from distft.parallel import STRATEGIES  # the registry imports strategies, which import config

    _choice(cfg.train.method, METHODS, "train.method")
    _choice(cfg.model.dtype, DTYPES, "model.dtype")
    _choice(cfg.model.attn_implementation, ("sdpa", "eager"), "model.attn_implementation")
    _choice(cfg.data.truncation, TRUNCATIONS, "data.truncation")
    _choice(cfg.train.device, ("auto", "cpu", "cuda"), "train.device")
    _choice(cfg.train.on_nonfinite, ("stop", "skip"), "train.on_nonfinite")
    _choice(cfg.parallel.strategy, sorted(STRATEGIES), "parallel.strategy")
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
    }
    for where, value in positive.items():
        if value <= 0:
            raise ConfigError(f"`{where}` must be positive, got {value}.")
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
    if cfg.output.checkpoint_every < 0 or cfg.output.keep_last < 1:
        raise ConfigError(
            "`output.checkpoint_every` cannot be negative and `output.keep_last` must be at least 1."
        )
    if cfg.optim.warmup_steps < 0 or cfg.optim.grad_clip < 0 or cfg.train.eval_every < 0:
        raise ConfigError(
            "`optim.warmup_steps`, `optim.grad_clip` and `train.eval_every` cannot be negative."
        )
    if not 0.0 < cfg.data.validation_fraction < 1.0:
        raise ConfigError(
            f"`data.validation_fraction` must be in (0, 1), got {cfg.data.validation_fraction}."
        )
    if not 0 <= cfg.parallel.node_rank < cfg.parallel.nnodes:
        raise ConfigError(
            f"`parallel.node_rank` is {cfg.parallel.node_rank} but there are {cfg.parallel.nnodes} nodes "
            f"(ranks 0..{cfg.parallel.nnodes - 1})."
        )
    strategy = STRATEGIES[cfg.parallel.strategy]
    if cfg.train.method == "qlora":
        if cfg.model.quant_block_size <= 0 or cfg.model.quant_block_size % 2:
            raise ConfigError(
                f"`model.quant_block_size` must be a positive even number, got {cfg.model.quant_block_size}."
            )
        if cfg.model.quant_scaler_block_size <= 0:
            raise ConfigError(
                f"`model.quant_scaler_block_size` must be positive, got {cfg.model.quant_scaler_block_size}."
            )
        if not strategy.supports_qlora:
            raise ConfigError(
                f"--method qlora cannot run with --strategy {strategy.name}: {strategy.qlora_refusal}. "
                f"QLoRA runs with {', '.join(s for s, c in STRATEGIES.items() if c.supports_qlora)}; "
                f"or keep --strategy {strategy.name} with --method lora."
            )
    mesh = [name for name, c in STRATEGIES.items() if c.mesh_degrees]
    if not strategy.mesh_degrees and (cfg.parallel.dp or cfg.parallel.tp != 1 or cfg.parallel.pp != 1):
        raise ConfigError(
            f"parallel.dp, parallel.tp and parallel.pp set the mesh of a multi-dimensional strategy "
            f"({', '.join(mesh)}); --strategy {strategy.name} takes its layout from --nproc alone. Drop them, "
            f"or use --strategy {' or '.join(mesh)}."
        )
    if cfg.parallel.max_restarts < 0:
        raise ConfigError(f"`parallel.max_restarts` cannot be negative, got {cfg.parallel.max_restarts}.")
    if cfg.parallel.max_restarts and not strategy.distributed:
        raise ConfigError(
            f"--max-restarts is handled by torchrun's elastic agent, which --strategy {cfg.parallel.strategy} "
            "does not use (it runs in this process). Pick a multi-process strategy (e.g. --strategy ddp "
            "--nproc 1), or rerun with --resume DIR after a failure."
        )
    strategy.validate_config(cfg)
    dp, micro = strategy.data_parallel_size(cfg), strategy.micro_batch_size(cfg)
    per_step = micro * dp
    if cfg.train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size ({cfg.train.global_batch_size}) must be a multiple of "
            f"train.micro_batch_size x data-parallel ranks ({micro} x {dp} = {per_step}), "
            "so every rank runs the same number of whole micro-batches."
        )


def grad_accumulation_steps(cfg: Config) -> int:
    from distft.parallel import STRATEGIES

    strategy = STRATEGIES[cfg.parallel.strategy]
    return cfg.train.global_batch_size // (strategy.micro_batch_size(cfg) * strategy.data_parallel_size(cfg))


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def to_toml(cfg: Config) -> str:
    lines: list[str] = []
    for section in dataclasses.fields(cfg):
        lines.append(f"[{section.name}]")
        for key, value in dataclasses.asdict(getattr(cfg, section.name)).items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def config_differences(a: Config, b: Config, ignore: tuple[str, ...] = ()) -> list[str]:
    """`section.key: a -> b` for every field that differs, skipping the dotted names in `ignore`."""
    diffs = []
    da, db = to_dict(a), to_dict(b)
    for section, table in da.items():
        for key, value in table.items():
            name = f"{section}.{key}"
            if name not in ignore and db[section][key] != value:
                diffs.append(f"{name}: {value!r} -> {db[section][key]!r}")
    return diffs
