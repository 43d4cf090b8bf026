"""The planner on a training config: `--strategy auto`, `--dry-run`, and the prediction every run
records beside what it measured.

`request_for(cfg)` is the `distft plan` question a `distft train` command asks: its model, method,
dtype, sequence length, micro-batch, LoRA rank, checkpointing and attention, on `--nproc` x
`--nnodes` devices of the memory this machine has (a CUDA device's, read from the device, with its
row of the GPU table for the peak that times a step; on the CPU each process's share of the
host's, and no peak: no time). `resolve_auto` walks the decision tree (`decide`) and
applies its answer to the settings the user left unset; `predict` estimates the layout the config
runs (`parallelism_of`: the runtime's own degrees, shard groups and pipeline) for `Config.prediction`,
which ranks.json and the end-of-run summary set beside the measured peak memory and counted bytes,
and every step record beside its measured time (`step_time`, the parts of `StepTime`; null on a
device with no bf16 peak).
"""

from __future__ import annotations

from dataclasses import asdict, replace

import psutil
import torch

from distft.config import Config, apply_override, lora_target_names
from distft.config.choices import PLANNED_SCHEDULES, WITH_REFERENCE, batch_unit
from distft.data import mean_label_tokens
from distft.data.pairs import rows_per_item, run_splits
from distft.errors import ConfigError
from distft.layout import SPECS, ParallelDims
from distft.measure.flops import StepTime
from distft.measure.gpus import gpu_for_device_name
from distft.model import DTYPES, is_preset, tokenizer_ranks
from distft.model.nf4 import NF4Spec
from distft.model.preference import STATS
from distft.parallel import STRATEGIES, check_config, master_weights
from distft.parallel.derive import derive_defaults, derived_line
from distft.parallel.pipeline.cost import DEFAULT_LABEL_TOKENS
from distft.plan.collective import bytes_by_kind
from distft.plan.decide import decide
from distft.plan.estimate import Request, estimate
from distft.plan.hardware import (
    GPU,
    format_bytes,
    format_seconds,
    generic_gpu,
    inter_node_link,
    intra_node_link,
)
from distft.plan.inputs import PRECISIONS, DDPSettings, Parallelism, Precision, Training
from distft.plan.model_spec import resolve_model
from distft.plan.traffic import step_collectives
from distft.text import plural


def on_cuda(cfg: Config) -> bool:
    return cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())


def device_memory(cfg: Config) -> tuple[int, str]:
    """Bytes one process may fill, and where that figure comes from."""
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "train.device=cuda, but this machine has no CUDA device; use train.device=cpu or auto."
        )
    if on_cuda(cfg):
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, f"{props.name}, {format_bytes(props.total_memory)}"
    total = psutil.virtual_memory().total
    share = total // cfg.parallel.nproc  # the processes of a node share its memory
    where = f"CPU: {format_bytes(share)} each, 1/{cfg.parallel.nproc} of the host's {format_bytes(total)}"
    return share, where


def device_gpu(cfg: Config, memory: int, where: str) -> GPU:
    """This machine's device as a GPU row: the table's (its peak times a step) with the device's
    memory; a GPU the table lacks, or the CPU, as a row without a peak."""
    if on_cuda(cfg):
        row = gpu_for_device_name(torch.cuda.get_device_name(0))
        return replace(row, memory=memory) if row else replace(generic_gpu(memory), label=where.split(",")[0])
    return replace(generic_gpu(memory), label="cpu", pcie="gloo-host")  # its processes talk over gloo


def training_of(cfg: Config, precision: Precision, **shape) -> Training:
    """What `cfg` trains, as the planner models it: the method, the LoRA adapters (their module
    names: a preset expanded) and variant, fp32 master weights where the run keeps them
    (`master_weights`), sequence length, checkpointing and attention; `shape` overrides the rest
    (micro-batch, autocast, labelled positions)."""
    fields = {
        "method": cfg.train.method,
        "precision": precision,
        "lora_rank": cfg.lora.rank,
        "lora_targets": tuple(lora_target_names(cfg.lora.target_modules)),
        "dora": cfg.lora.variant == "dora",
        "optimizer": cfg.optim.name,
        "sgd_momentum": cfg.optim.momentum > 0,
        "pair_statistics": 0 if cfg.train.objective == "sft" else len(STATS),
        "reference_forward": cfg.train.objective in WITH_REFERENCE and not cfg.dpo.precompute_reference,
        "kl_forwards": (1 + (not cfg.dpo.precompute_reference)) if cfg.train.objective == "kto" else 0,
        "modules_to_save": tuple(cfg.lora.modules_to_save),
        "trainable_tokens": len(dict.fromkeys(cfg.model.added_tokens)),
        "fp32_masters": master_weights(cfg) == "fp32",
        "seq_len": cfg.data.max_length,
        "micro_batch": cfg.train.micro_batch_size * rows_per_item(cfg.train.objective),
        "label_tokens": min(DEFAULT_LABEL_TOKENS, cfg.data.max_length),  # the runtime measures its data's
        "activation_checkpointing": cfg.model.activation_checkpointing,
        "mlp_tiles": cfg.model.mlp_tiles,
        "attention": cfg.model.attn_implementation,
        "quant": NF4Spec.from_config(cfg.model),
        **fsdp_dtype_bytes(cfg),
    }
    return Training(**(fields | shape))


def fsdp_dtype_bytes(cfg: Config) -> dict[str, int]:
    """FSDP2's dtype overrides (parallel.fsdp_*_dtype) as `Training` takes them, where FSDP runs."""
    spec, p = SPECS.get(cfg.parallel.strategy), cfg.parallel
    if spec is None or spec.wraps != "fully_shard":
        return {}
    dtypes = {"param": p.fsdp_param_dtype, "reduce": p.fsdp_reduce_dtype, "output": p.fsdp_output_dtype}
    return {f"fsdp_{k}_bytes": DTYPES[v].itemsize for k, v in dtypes.items() if v}


def data_label_tokens(cfg: Config) -> float | None:
    """The mean labelled positions of `cfg`'s training rows, as its run measures them before launch
    (`train.prepare`); None where its data or tokenizer cannot be read here (a hub id offline):
    the planner's default then."""
    try:
        name = cfg.model.name
        train, _, _ = run_splits(cfg, None if is_preset(name) else name, tokenizer_ranks(name))
    except ConfigError:
        return None
    return mean_label_tokens(train)


def request_for(
    cfg: Config, micro_batch: int | None = None, accumulation: int = 1, label_tokens: float | None = None
) -> tuple[Request, str]:
    """The planner's question for `cfg` on this machine, and the memory's source; `label_tokens`:
    the data's labelled positions per row (the runtime's measure), else the planner's default."""
    memory, where = device_memory(cfg)
    gpu = device_gpu(cfg, memory, where)
    rows = (micro_batch or cfg.train.micro_batch_size) * rows_per_item(cfg.train.objective)
    training = training_of(
        cfg,
        PRECISIONS["fp32" if cfg.model.dtype == "float32" else "bf16-pure"],
        autocast=on_cuda(cfg) and cfg.model.autocast,
        micro_batch=rows,
        packed=cfg.data.packing and rows > 1,
        device="cuda" if on_cuda(cfg) else "cpu",  # the kernels attention runs here (`plan.attention`)
        **({"label_tokens": min(label_tokens, cfg.data.max_length)} if label_tokens else {}),
    )
    par = cfg.parallel
    request = Request(
        model=resolve_model(cfg.model.name),
        training=training,
        gpu=gpu,
        gpu_memory=memory,
        gpus_per_node=par.nproc,
        nodes=par.nnodes,
        intra=intra_node_link(gpu, None, par.nproc),
        inter=inter_node_link(None),
        grad_accum=accumulation,
        pp_schedule=par.schedule if par.schedule in PLANNED_SCHEDULES else "1f1b",  # its own where modelled
        overhead=min(1 << 30, memory // 8),
        cp_method=par.cp_method,
    )
    return request, where


# ---- --strategy auto -----------------------------------------------------------------------------


def complete(cfg: Config, say_derived: bool = True) -> list[str]:
    """`--strategy auto` resolved, then the unset defaults derived (`distft.parallel.derive`), in
    place; the lines that say what was chosen and why (`say_derived`: and what was derived, which
    a run's header and a dry run say themselves)."""
    lines = [resolve_auto(cfg)] if cfg.parallel.strategy == "auto" else []
    derive_defaults(cfg)
    if say_derived and (line := derived_line(cfg)):
        lines.append(line)
    return lines


def resolve_auto(cfg: Config) -> str:
    """Replace `--strategy auto` by the planner's answer (in place); the paragraph saying why."""
    req, where = request_for(cfg)
    rec = decide(req)
    if rec.strategy is None:
        raise ConfigError(f"--strategy auto: {rec.reason}")
    changes = {"train.method": rec.method, "model.activation_checkpointing": rec.activation_checkpointing}
    current = {
        "train.method": cfg.train.method,
        "model.activation_checkpointing": cfg.model.activation_checkpointing,
    }
    for key, value in changes.items():
        if value != current[key] and key in cfg.explicit:
            raise ConfigError(
                f"--strategy auto: the plan needs {key}={str(value).lower()}, but {key} is set to "
                f"{str(current[key]).lower()}. {rec.reason}"
            )
    cfg.train.method, cfg.model.activation_checkpointing = rec.method, rec.activation_checkpointing
    cfg.parallel.strategy = rec.strategy
    lay = rec.parallelism
    if lay is not None:  # the planned mesh, shard groups, expert groups and the experts' layout
        for key, value in lay.dims.to_overrides(SPECS[rec.strategy]).items():
            apply_override(cfg, f"{key}={value}")
        cfg.parallel.shard_experts = cfg.parallel.shard_experts or lay.shard_experts
    cfg.derived = {
        **cfg.derived,
        "parallel.strategy": f"{rec.strategy}: the planner's choice (--strategy auto)",
    }
    ckpt = rec.activation_checkpointing
    ckpt_note = f" Activation checkpointing: {ckpt}." if ckpt != "none" else ""
    reason = device_words(cfg, rec.reason)
    return f"strategy auto: {rec.label} on {plural(cfg.world_size, 'process')} ({where}). {reason}{ckpt_note}"


# ---- the prediction for the layout a config runs ----------------------------------------------------


def parallelism_of(cfg: Config, schedule: str) -> Parallelism:
    """The planner's `Parallelism` for the layout the runtime builds from `cfg`: the same degrees
    (`ParallelDims.of`), shard groups, sequence parallelism, DDP switches and pipeline (run with
    `schedule`, the one the planner models)."""
    cls, shape, p = STRATEGIES[cfg.parallel.strategy], check_config(cfg), cfg.parallel
    par = Parallelism.of(
        cls.spec,
        ParallelDims.of(cls.spec, cfg),
        microbatches=shape.accumulation_steps,
        schedule=schedule,
        shard_experts=p.shard_experts,
    )
    if cls.spec.tensor_parallel == "megatron":
        par = replace(par, sp=p.sequence_parallel)
    if "cp" in cls.spec.dims:
        par = replace(par, cp_method=p.cp_method)
    if cls.spec.wraps == "ddp":
        switches = (p.ddp_no_sync, p.ddp_find_unused_parameters, p.ddp_broadcast_buffers, p.ddp_static_graph)
        par = replace(par, ddp=DDPSettings(*switches))
    if cls.spec.pipelined:
        lay, split = cls.pipeline_layout(cfg), p.pp_split
        split = split if isinstance(split, str) else tuple(split)
        par = replace(par, microbatches=lay.microbatches, stages_per_rank=lay.stages_per_rank, pp_split=split)
    return par


def predict(cfg: Config, label_tokens: float | None = None) -> dict:
    """The planner's figures for this run's layout: peak bytes of the fullest rank and bytes each
    rank moves per step, by kind (`distft.measure.comm`'s logical bytes); with the data's
    `label_tokens` per row where the data was read (the loss head's share, a pipeline's cut)."""
    shape = check_config(cfg)
    req, where = request_for(cfg, shape.micro_batch_size, shape.accumulation_steps, label_tokens)
    layout = parallelism_of(cfg, req.pp_schedule)
    est = estimate(req, layout, cfg.parallel.strategy)
    by_pp_rank = [  # a pipeline's ranks hold different stages; every other layout's ranks move the same
        bytes_by_kind(step_collectives(req.model, req.training, layout, req.topology, rank))
        for rank in range(layout.pp)
    ]
    return {
        "layout": f"{est.label} on {plural(cfg.world_size, 'process')}",  # with its mesh, groups
        "device": where,
        "peak_mem_bytes": int(est.total),
        "by_component": {k: int(v) for k, v in est.components.items()},
        # What autograd keeps between forward and backward (what a run's probe measures), the
        # working set on top of it, and offloaded layer inputs in host memory.
        "activations": {  # none where the layout is not one the planner models (one FSDP rank)
            "saved": int(est.activations - est.activation_detail.get("transient", 0)),
            "transient": int(est.activation_detail.get("transient", 0)),
            "host": int(est.host_activations),
        },
        "fits": est.fits,
        "modelled": est.applicable,  # false: a layout the planner does not model (one FSDP rank); no verdict
        "usable_bytes": req.usable,
        "comm_bytes": by_pp_rank[0],
        "comm_bytes_by_pp_rank": by_pp_rank,
        "step_time": asdict(est.time) if est.time else None,  # `distft.measure.flops.StepTime`'s fields
        "step_time_note": req.no_time,  # why step_time is null (no bf16 peak), else null
    }


def try_predict(cfg: Config, label_tokens: float | None = None) -> dict | None:
    """`predict`, or None where the planner cannot model the model (offline, an unknown hub id)."""
    try:
        return predict(cfg, label_tokens)
    except ConfigError:
        return None


def prediction_line(prediction: dict) -> str:
    parts = ", ".join(
        f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in prediction["by_component"].items()
    )
    comm = sum(prediction["comm_bytes"].values())
    verdict = "fits" if prediction["fits"] else "does NOT fit"
    if not prediction.get("modelled", True):
        verdict = "no verdict (a layout the planner does not model)"
    time = prediction.get("step_time")
    step = format_seconds(StepTime(**time).seconds) if time else f"n/a ({prediction.get('step_time_note')})"
    return (
        f"plan for {prediction['layout']} ({prediction['device']}): {format_bytes(prediction['peak_mem_bytes'])} "
        f"per process at the fullest ({parts}); {verdict} in {format_bytes(prediction['usable_bytes'])} usable; "
        f"{format_bytes(comm)} of collectives per process per step; step time {step}"
    )


def device_words(cfg: Config, text: str) -> str:
    """The decision tree's text, which speaks of GPUs (it answers `distft plan`), in the words of a
    CPU run, where each process is a device."""
    if on_cuda(cfg):
        return text
    return text.replace("GPUs", "processes").replace("GPU", "process")


def dry_run(cfg: Config) -> int:
    """`distft train --dry-run`, after every check before launch passed: what would run."""
    shape = check_config(cfg)
    print("dry run: every check before launch passed; nothing trained, nothing written")
    if line := derived_line(cfg):
        print(line)
    print(
        f"strategy {cfg.parallel.strategy} on {plural(cfg.world_size, 'process')}: global batch "
        f"{cfg.train.global_batch_size}{batch_unit(cfg.train.objective)} = micro-batch {shape.micro_batch_size} "
        f"x accumulation {shape.accumulation_steps} x data-parallel ranks {shape.data_parallel_size}; "
        f"{cfg.data.max_length} tokens per sequence"
        + (", 2 sequences a pair" if rows_per_item(cfg.train.objective) > 1 else "")
        + f"; optim.lr {cfg.optim.lr:g}"
    )
    prediction = cfg.prediction or try_predict(cfg)
    print(prediction_line(prediction) if prediction else "plan: the planner cannot model this model offline")
    return 0
