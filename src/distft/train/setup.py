"""Everything a run needs before its first step, built in one visible order.

process group -> health check -> tokenizer -> data -> base model -> method (LoRA, QLoRA, full) ->
loss head (`LossLM`) -> parallelize -> optimizer + scheduler -> resume. `setup` returns it all as
a `Run`, which the loop and `distft.train.step` read; nothing here trains.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from distft.config import Config, to_toml
from distft.data import CachedSplit, TokenizedSplit, mean_label_tokens
from distft.data.pairs import training_splits
from distft.data.rows import memory_source
from distft.data.tokenizer import cache_root, load_tokenizer, with_added_tokens
from distft.distributed import (
    DistEnv,
    decided_by_rank_zero,
    init_distributed,
    naming_collective,
    restart_count,
)
from distft.errors import ConfigError
from distft.health import HealthHooks, HealthReport, check_health, failure_advice
from distft.io.checkpoint import (
    check_resume,
    clear_checkpoints,
    load_training_state,
    read_loop_state,
    resume_hint,
    set_aside_newer,
)
from distft.io.files import atomic_write_text
from distft.io.lineage import run_lineage, write_lineage
from distft.io.save import base_weights_written, save_base
from distft.measure.flops import ModelFlops, peak_flops
from distft.model import (
    LossLM,
    apply_method,
    causal_lm,
    count_parameters,
    is_preset,
    load_base_model,
    tokenizer_ranks,
)
from distft.model.attention import resolve_attention
from distft.model.build import base_recipe, pretrained_origin
from distft.model.checkpointing import enable_checkpointing
from distft.model.compile import (
    CompileStats,
    compile_blocks,
    compile_cache_dir,
    compile_wanted,
    use_compile_cache,
)
from distft.model.fp8 import check_fp8_hardware
from distft.model.nf4 import storage_layout
from distft.model.nf4_linear import dequantize_compiled_wanted, use_compiled_dequantize
from distft.model.preference import preference_loss
from distft.model.presets import DTYPES
from distft.model.router import router_losses
from distft.parallel import STRATEGIES, BatchShape, Strategy, check_config, check_model, master_weights
from distft.plan.model_spec import ModelSpec, spec_from_config
from distft.tensors import local_bytes
from distft.train.early_stopping import EarlyStopping
from distft.train.hooks import TrainHooks
from distft.train.optim import build_optimizer, check_optimizer, epoch_steps, lr_lambda


@dataclass
class Run:
    """One training run, set up: what the loop steps, and what it reports at the start and end."""

    cfg: Config
    shape: BatchShape  # how the global batch is cut (`distft.parallel.checks`)
    env: DistEnv
    strategy: Strategy
    out: Path
    tokenizer: object
    train_set: TokenizedSplit | CachedSplit  # examples by position: in memory, or memory-mapped
    val_set: TokenizedSplit | CachedSplit
    base_ref: str  # what the exported adapter names as its base model
    parameters: tuple[int, int]  # (trainable, total), before parallelizing
    model: torch.nn.Module  # the parallelized `LossLM`
    param_bytes: dict[str, int]  # this rank's parameters at rest (`distft.model.nf4.storage_layout`)
    grad_bytes: int  # this rank's gradients, counted before any forward
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    autocast: contextlib.AbstractContextManager
    start_step: int = 0  # the step of the checkpoint resumed from; 0 for a new run
    checkpoint: Path | None = None
    skipped_checkpoints: list[str] = field(default_factory=list)  # damaged ones passed over on resume
    compiled: CompileStats | None = None  # what torch.compile built, per rank (`distft.model.compile`)
    attention: str = "sdpa"  # the attention kernel that runs (`distft.model.attention`)
    compiled_nf4: int = 0  # NF4 projections whose dequantisation runs compiled (`distft.model.nf4_linear`)
    flops: ModelFlops | None = None  # the step's model FLOPs (`distft.measure.flops`)
    peak_flops: float | None = None  # one device's peak dense bf16 FLOP/s; None off a known GPU
    peak_note: str = ""  # what MFU is measured against, or why it is null
    lineage: dict | None = None  # where the model came from, and its chain of runs (`distft.io.lineage`)
    health: HealthReport | None = None  # the pre-flight health check's (`distft.health`); None: not run
    token_cache: dict | None = None  # how this rank had its examples (`distft.data.cache.tokenized_splits`)
    architecture: ModelSpec | None = None  # the built model's shapes, for the bytes formula (`distft.plan`)
    early_stopping: EarlyStopping = field(default_factory=EarlyStopping)  # the best validation loss so far
    statistics: dict = field(default_factory=dict)  # the last step's (or validation's): pairs', routers'
    step_lr: float = 0.0  # the learning rate the last step's update used (the scheduler has moved on since)
    pending: dict | None = None  # resumed before its step's validation: that step's record (`train.loop`)
    hooks: TrainHooks = field(default_factory=TrainHooks)  # the callbacks `train` was given (`train.hooks`)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    def collective(self, what: str) -> contextlib.AbstractContextManager:
        """Run collectives; a timeout or a lost peer names this rank and `what`, and the resume."""

        def advice() -> str:
            nccl = failure_advice(os.environ, self.env.backend)  # NCCL_DEBUG=INFO, where it is off
            return f"{resume_hint(self.out)} If the wait was legitimate, raise parallel.timeout_s. {nccl}".strip()

        return naming_collective(self.env, what, self.cfg.parallel.timeout_s, advice)


def setup(cfg: Config, dataset: Any = None, health_hooks: HealthHooks | None = None) -> Run:
    """`dataset`: in-memory rows (`distft.data.load_rows`) instead of `cfg.data.source`;
    `health_hooks`: fault points inside the health check (tests only)."""
    shape = check_config(cfg)  # pure; the CLI ran it before launch, a Python caller may not have
    strategy_cls = STRATEGIES[cfg.parallel.strategy]
    env = init_distributed(cfg.train.device, cfg.parallel.timeout_s, need_group=strategy_cls.spec.distributed)
    check_optimizer(cfg, env.device)
    check_fp8_hardware(cfg.model.fp8, env.device)  # this rank's GPU: sm89+ (the CLI checked before launch)
    # Every rank answers and all-reduces once before anything slow is built (docs/multi-node.md).
    health = (
        check_health(env, cfg.parallel, health_hooks)
        if cfg.parallel.health_check and env.world_size > 1
        else None
    )
    strategy = strategy_cls(cfg, env)
    out = Path(cfg.output.dir)

    if dataset is not None:  # what the run trained on, in its config.toml, header and lineage
        dataset = list(dataset) if isinstance(dataset, Iterator) else dataset  # read twice
        cfg.data.source = memory_source(dataset)
    model = None if is_preset(cfg.model.name) else cfg.model.name
    tokenizer = load_tokenizer(  # data.chat_template
        model, cfg.model.revision, cfg.data.chat_template, tokenizer_ranks(cfg.model.name)
    )
    tokenizer = with_added_tokens(tokenizer, cfg.model.added_tokens)  # model.added_tokens
    # The token cache (built before launch by the CLI), or pairs for a preference objective.
    splits = training_splits(cfg, tokenizer, dataset)
    train_set, val_set, token_cache = splits
    if cfg.train.epochs > 0:  # the run's length, from the rows every rank counts alike
        cfg.train.max_steps = epoch_steps(cfg, len(train_set))

    # Built where it will train, in its dtype, when the strategy takes a whole model on its device.
    attention = resolve_attention(cfg.model.attn_implementation, env.device, DTYPES[cfg.model.dtype])
    base = load_base_model(cfg.model, env.device if strategy.spec.builds_on_device else None, attention)
    check_model(cfg, base.config)
    architecture = run_architecture(cfg, base.config)
    masters = master_weights(cfg) == "fp32"
    if masters:  # full finetuning of a bf16 base: fp32 master weights, bf16 compute (autocast below)
        base = base.float()
    recipe = base_recipe(cfg.model, base.device) if is_preset(cfg.model.name) else None
    # random preset (or where a pretrained base came from) -> earlier runs -> this one
    lineage = run_lineage(cfg, recipe, None if recipe else pretrained_origin(cfg.model))
    if env.is_main:
        atomic_write_text(out / "config.toml", to_toml(cfg))
        write_lineage(out, lineage)
        if recipe is not None:  # the recipe always; the weights when small (`io.save`)
            save_base(base, tokenizer, out / "base", recipe, weights=base_weights_written(cfg))
    base_ref = str((out / "base").resolve()) if is_preset(cfg.model.name) else cfg.model.name

    torch.manual_seed(cfg.train.seed)  # LoRA's random init: identical on every rank
    lm = apply_method(base, cfg, tokenizer)
    enable_checkpointing(causal_lm(lm), cfg.model.activation_checkpointing, cfg.model.mlp_tiles)
    parameters = count_parameters(lm)
    flops = ModelFlops.from_model(lm)  # whole, before a strategy shards it
    compiled = compiled_blocks(lm, cfg, env.device, strategy)  # None: eager
    nf4_compiled = dequantize_compiled_wanted(cfg.model.compile, env.device)  # QLoRA: one kernel per weight
    compiled_nf4 = use_compiled_dequantize(lm, nf4_compiled) if nf4_compiled else 0
    strategy.label_tokens = mean_label_tokens(train_set)  # a pipeline cuts its stages by them
    router = router_losses(causal_lm(lm).model, cfg.moe.aux_loss_coef, cfg.moe.z_loss_coef)  # an MoE's
    model = strategy.parallelize(LossLM(lm, preference_loss(cfg.train.objective, cfg.dpo), router))
    param_bytes = storage_layout(model)  # NF4 parts apart (distft.model.nf4)
    # Gradients are freed after every step, each with its (sharded) parameter's shape: counted here,
    # before a forward-only pass can leave ZeRO-2's parameters gathered.
    grad_bytes = local_bytes(p for p in model.parameters() if p.requires_grad)

    optimizer = build_optimizer(model, cfg, strategy)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    use_autocast = (cfg.model.autocast and env.device.type == "cuda") or masters
    autocast = (
        torch.autocast(env.device.type, dtype=torch.bfloat16) if use_autocast else contextlib.nullcontext()
    )

    run = Run(cfg, shape, env, strategy, out, tokenizer, train_set, val_set, base_ref, parameters, model,
              param_bytes, grad_bytes, optimizer, scheduler, autocast, compiled=compiled, attention=attention, compiled_nf4=compiled_nf4, flops=flops)  # fmt: skip
    run.peak_flops, run.peak_note = peak_flops(env.device)
    run.lineage, run.health, run.token_cache = lineage, health, token_cache
    run.architecture = architecture
    run.early_stopping = EarlyStopping(cfg.train.early_stopping_patience, cfg.train.early_stopping_delta)
    resume(run)
    return run


def compiled_blocks(
    lm: torch.nn.Module, cfg: Config, device: torch.device, strategy: Strategy
) -> CompileStats | None:
    """Each decoder layer compiled, before the strategy wraps them (`distft.model.compile`), what
    inductor builds kept under `model.compile_cache` for the next run; None where the run stays eager."""
    if not compile_wanted(cfg.model.compile, device, strategy.spec.runs("compile")):
        return None
    auto = cache_root() / "compile"  # distft's own cache dir, beside the token cache
    use_compile_cache(compile_cache_dir(cfg.model.compile_cache, auto, device))
    return compile_blocks(lm, cfg.model.compile_backend, strict=cfg.model.compile == "true")


def run_architecture(cfg: Config, model_config: PretrainedConfig) -> ModelSpec | None:
    """The built model as the planner counts it (None: an architecture it does not model)."""
    try:
        return spec_from_config(model_config.to_dict(), cfg.model.name, "the run's model")
    except ConfigError:
        return None


def _resumable(cfg: Config) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from (None: start over) and the damaged ones passed over."""
    skipped: list[str] = []
    # An elastic restart (torchrun --max-restarts) resumes its own run even with output.resume=false.
    return check_resume(cfg, force=restart_count() > 0, skipped=skipped), skipped


def resume(run: Run) -> None:
    """Load the latest checkpoint into `run`, if this run resumes; a new run clears old ones."""
    # Rank 0 reads and checksums the checkpoints; every rank resumes from its choice (or its refusal).
    with run.collective("choosing the checkpoint to resume from"):
        chosen, skipped = decided_by_rank_zero(run.env, lambda: _resumable(run.cfg))
    run.checkpoint, run.skipped_checkpoints = chosen, skipped
    if run.checkpoint is None and run.env.is_main and restart_count() == 0:
        clear_checkpoints(run.out)  # starting over: the old run's checkpoints would outrank ours
    if run.checkpoint is not None:
        if run.skipped_checkpoints and run.env.is_main:
            set_aside_newer(run.out, run.checkpoint)
        with run.collective(f"loading {run.checkpoint}"):
            state = run.strategy.checkpoint_state(run.model, run.optimizer)
            run.start_step = load_training_state(run.checkpoint, state, run.scheduler, run.env.rank)
            run.strategy.load_checkpoint_state(run.model, run.optimizer, state)
        loop = read_loop_state(run.checkpoint)
        run.early_stopping.load_state_dict(loop.get("early_stopping"))
        run.pending = loop.get("pending")
