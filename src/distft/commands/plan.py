"""`distft plan`'s flags. The command is `distft.plan`'s (`make_request` checks them, `cmd_plan`
answers)."""

from __future__ import annotations

import argparse

from distft.config.choices import (
    ATTENTION_CHOICES,
    CHECKPOINTING,
    CP_METHODS,
    PLANNED_SCHEDULES,
    ROPE_SCALINGS,
)
from distft.config.precision import PRECISIONS
from distft.errors import ConfigError
from distft.measure.gpus import GPUS, INTERCONNECTS, find_gpu

# The flags that say what a training config says, and the setting each one is (`distft train`'s
# names): with --config or section.key=value overrides they are applied on top, as train's flags
# are; alone, the planner's defaults (`PLAN_DEFAULTS`) fill those not given.
PLAN_FLAGS = {
    "model": "model.name",
    "method": "train.method",
    "gpus": "parallel.nproc",
    "nodes": "parallel.nnodes",
    "seq_len": "data.max_length",
    "rope_scaling": "model.rope_scaling",
    "rope_factor": "model.rope_factor",
    "mlp_tiles": "model.mlp_tiles",
    "micro_batch": "train.micro_batch_size",
    "attention": "model.attn_implementation",
    "lora_rank": "lora.rank",
    "lora_variant": "lora.variant",
    "master_weights": "train.master_weights",
    "activation_checkpointing": "model.activation_checkpointing",
    "pp_schedule": "parallel.schedule",
    "cp_method": "parallel.cp_method",
}
PLAN_DEFAULTS = {
    "method": "lora",
    "gpus": 1,
    "nodes": 1,
    "seq_len": 2048,
    "rope_scaling": "none",
    "rope_factor": 0.0,
    "mlp_tiles": 0,
    "micro_batch": 1,
    "attention": "auto",
    "lora_rank": 16,
    "lora_variant": "lora",
    "activation_checkpointing": "none",
    "pp_schedule": "1f1b",
    "cp_method": "allgather",
    "precision": "mixed",
    "grad_accum": 1,
    "label_tokens": 256,
}


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="memory and time per GPU for every strategy, and which one to use",
        description="Estimate, for every parallel strategy, the bytes each GPU holds (parameters, gradients, "
        "optimizer state, activations, communication buffers), whether that fits, the bytes moved per "
        "step and their time on the interconnect, the time of a step and of the run; then walk the "
        "decision tree to a recommendation. Ask with flags, or with a training config as `distft train` "
        "takes it (--config FILE, section.key=value overrides: an objective, an optimizer, "
        "lora.modules_to_save, added tokens, FSDP dtypes), the flags below applied on top; a config's own "
        "strategy is estimated in its own layout, the figures `distft train --dry-run` predicts.",
    )
    p.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="settings, as distft train takes them"
    )
    p.add_argument("--config", help="a training config (TOML), as distft train --config takes it")
    p.add_argument(
        "--model",
        help="preset, hub id (Qwen/Qwen3-4B, meta-llama/Llama-3.1-8B, llama-3-70b ...), directory or config.json",
    )
    p.add_argument("--method", choices=["full", "lora", "qlora"], help="what trains (default lora)")
    p.add_argument("--gpus", type=int, help="GPUs per node (default 1; with a config: its --nproc)")
    p.add_argument("--nodes", type=int, help="nodes (default 1)")
    p.add_argument("--gpu", help=f"GPU profile: {', '.join(GPUS)}")
    p.add_argument("--gpu-mem", help="memory per GPU, e.g. 24GiB, 80GB (default: the profile's)")
    p.add_argument(
        "--interconnect",
        choices=INTERCONNECTS,
        help="link between GPUs of a node (pcie, nvlink: the profile's generation) or between nodes "
        "(infiniband = NDR 400 Gb/s, ib-hdr = 200 Gb/s); default: the profile's link inside a node, NDR between",
    )
    _add_sequence_arguments(p)
    p.add_argument(
        "--attention",
        choices=list(ATTENTION_CHOICES),
        help="attention kernel (model.attn_implementation)",
    )
    p.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        help="bytes per weight/grad/state (default mixed; with a config: its model.dtype's)",
    )
    p.add_argument("--lora-rank", type=int, help="LoRA rank (all attention and MLP projections; default 16)")
    p.add_argument(
        "--lora-variant",
        choices=["lora", "dora", "rslora"],
        help="lora.variant: dora adds a trained magnitude per output feature (counted); rslora changes no memory",
    )
    p.add_argument(
        "--master-weights",
        choices=["fp32", "model"],
        help="full finetuning: fp32 counts distft's train.master_weights=fp32 (fp32 weights, gradients and "
        "moments, bf16 compute); default: as --precision says",
    )
    _add_layout_arguments(p)
    p.add_argument(
        "--mfu",
        type=float,
        help="model FLOPs utilisation assumed for compute time (default: distft's measured 0.37 LoRA, "
        "0.36 QLoRA, 0.43 full finetuning; docs/plan.md)",
    )
    p.add_argument(
        "--tokens", help="tokens in the training data (50M, 1.2B): the run's length, with --epochs"
    )
    p.add_argument("--epochs", type=float, default=1.0, help="passes over --tokens (default 1)")
    p.add_argument(
        "--steps", type=int, help="optimizer steps of the run (train.max_steps); instead of --tokens"
    )
    p.add_argument(
        "--overhead", default="1GiB", help="memory per GPU not available to tensors (default 1GiB)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    # The tables travel with the arguments: the planner (`distft.plan`, a layer that cannot import
    # this one) reads which setting each flag is, and the defaults of the flags alone.
    p.set_defaults(flag_settings=PLAN_FLAGS, flag_defaults=PLAN_DEFAULTS, check=check_plan_flags)


def check_plan_flags(args: argparse.Namespace) -> None:
    """What the flags alone must say, refused before the planner (and torch) is imported: the model
    and the GPUs, unless a training config says them (its run is planned on this machine)."""
    if args.gpu is not None:
        find_gpu(args.gpu)
    if args.config is not None or args.overrides:
        return
    if args.model is None:
        raise ConfigError("Say what to plan: --model (a preset, hub id or directory), or --config FILE.")
    if args.gpu is None and args.gpu_mem is None:
        raise ConfigError(
            f"Say what the GPUs are: --gpu (one of {', '.join(GPUS)}) or --gpu-mem (e.g. 24GiB), or both."
        )


def _add_layout_arguments(p: argparse.ArgumentParser) -> None:
    """How the pipelines and context parallelism run, where a layout has them."""
    p.add_argument("--pp-schedule", choices=PLANNED_SCHEDULES, help="default 1f1b")
    p.add_argument("--pp-microbatches", type=int, help="micro-batches per pipeline step (default 2 x stages)")
    p.add_argument(
        "--cp-method",
        choices=CP_METHODS,
        help="context parallelism's attention (parallel.cp_method): allgather gathers every rank's K and V "
        "(default), ring passes them round, holding one share at a time",
    )


def _add_sequence_arguments(p: argparse.ArgumentParser) -> None:
    """What a sequence is and what its activations keep: length, positions, batch, checkpointing."""
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default 2048)")
    p.add_argument(
        "--rope-scaling",
        choices=list(ROPE_SCALINGS),
        help="stretch the rotary embeddings past the model's positions (model.rope_scaling; yarn for Qwen3)",
    )
    p.add_argument("--rope-factor", type=float, help="with --rope-scaling: the factor (> 1)")
    p.add_argument(
        "--mlp-tiles", type=int, help="the MLP in N checkpointed sequence slices (model.mlp_tiles)"
    )
    p.add_argument(
        "--expert-imbalance",
        type=float,
        default=1.0,
        help="a mixture of experts: the busiest expert-parallel rank's routed tokens over the even share "
        "(default 1.0, balanced; a run records its busiest expert's as expert_imbalance)",
    )
    p.add_argument("--micro-batch", type=int, help="sequences per forward on a GPU (default 1)")
    p.add_argument(
        "--grad-accum", type=int, help="micro-batches per optimizer step (default 1; with a config: its own)"
    )
    p.add_argument("--label-tokens", type=int, help="loss positions per sequence (default 256: a summary)")
    p.add_argument(
        "--activation-checkpointing",
        nargs="?",
        const="full",
        choices=list(CHECKPOINTING),
        help="what a layer keeps for backward (model.activation_checkpointing): full when given alone; "
        "selective recomputes the MLP only, offload moves each layer's input to host memory",
    )
