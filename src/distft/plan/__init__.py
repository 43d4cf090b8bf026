"""`distft plan`: how much GPU memory each strategy needs, what it moves, and which one to use.

Imports run one way, top to bottom:
- `model_spec`: the architecture as a list of weight tensors, from a transformers config and its
  model family (presets, hub ids known offline, config.json);
- `inputs`: precision, what trains (`Training`) and how ranks split it (`Parallelism`, whose
  pipeline is the runtime's `distft.parallel.pipeline.Layout`);
- `hardware`: GPU and link profiles, ring-collective volumes, `comm_time`;
- `memory`: parameters, gradients, optimizer state (NF4 by `distft.model.nf4`) and buffers per rank;
- `activations`: what autograd saves for backward per rank;
- `traffic`: the collectives of each layout per step, and which of them overlap compute;
- `timing`: time per step (model FLOPs at an assumed MFU, the bubble, exposed communication) and
  time to train;
- `estimate`: every layout evaluated (`Request`, `Estimate`, `evaluate`); which ones distft runs
  comes from the registry `distft.parallel.STRATEGIES`;
- `explain`, `decide`: the decision tree; `run_line`: the `distft train` line for the answer;
- `auto`: the planner on a training config (`--strategy auto`, `--dry-run`, the prediction a run
  records beside what it measured);
- `report`: the rich table and the JSON document.
"""

from __future__ import annotations

import argparse

from distft.config.choices import ATTENTION_CHOICES, CHECKPOINTING, ROPE_SCALINGS
from distft.errors import ConfigError
from distft.model.positions import check_positions, scale_rope
from distft.plan.activations import activation_bytes
from distft.plan.auto import complete, dry_run, predict, resolve_auto, try_predict
from distft.plan.decide import decide
from distft.plan.estimate import Estimate, Request, evaluate, parallelism_for, runnable
from distft.plan.explain import Recommendation
from distft.plan.hardware import (
    GPUS,
    INTERCONNECTS,
    LINKS,
    comm_time,
    find_gpu,
    generic_gpu,
    inter_node_link,
    intra_node_link,
    match_gpu,
    parse_bytes,
)
from distft.plan.inputs import PLANNED_SCHEDULES, PRECISIONS, Parallelism, Training
from distft.plan.memory import qlora_base_bytes, state_bytes
from distft.plan.model_spec import ModelSpec, resolve_model
from distft.plan.report import print_json, print_rich
from distft.plan.run_line import run_command, run_overrides
from distft.plan.timing import RunLength, parse_tokens

__all__ = [
    "GPUS",
    "LINKS",
    "PRECISIONS",
    "Estimate",
    "ModelSpec",
    "Parallelism",
    "Recommendation",
    "Request",
    "Training",
    "activation_bytes",
    "comm_time",
    "complete",
    "decide",
    "dry_run",
    "evaluate",
    "make_request",
    "parallelism_for",
    "predict",
    "qlora_base_bytes",
    "resolve_auto",
    "resolve_model",
    "run_command",
    "run_overrides",
    "runnable",
    "state_bytes",
    "try_predict",
]


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="memory and time per GPU for every strategy, and which one to use",
        description="Estimate, for every parallel strategy, the bytes each GPU holds (parameters, gradients, "
        "optimizer state, activations, communication buffers), whether that fits, the bytes moved per "
        "step and their time on the interconnect, the time of a step and of the run; then walk the "
        "decision tree to a recommendation.",
    )
    p.add_argument(
        "--model",
        required=True,
        help="preset, hub id (Qwen/Qwen3-4B, meta-llama/Llama-3.1-8B, llama-3-70b ...), directory or config.json",
    )
    p.add_argument(
        "--method", default="lora", choices=["full", "lora", "qlora"], help="what trains (default lora)"
    )
    p.add_argument("--gpus", type=int, default=1, help="GPUs per node (default 1)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
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
        default="auto",
        choices=list(ATTENTION_CHOICES),
        help="attention kernel (model.attn_implementation)",
    )
    p.add_argument(
        "--precision", default="mixed", choices=list(PRECISIONS), help="bytes per weight/grad/state"
    )
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA rank (all attention and MLP projections)")
    p.add_argument(
        "--lora-variant",
        default="lora",
        choices=["lora", "dora", "rslora"],
        help="lora.variant: dora adds a trained magnitude per output feature (counted); rslora changes no memory",
    )
    p.add_argument(
        "--master-weights",
        choices=["fp32", "model"],
        help="full finetuning: fp32 counts distft's train.master_weights=fp32 (fp32 weights, gradients and "
        "moments, bf16 compute); default: as --precision says",
    )
    p.add_argument("--pp-schedule", default="1f1b", choices=list(PLANNED_SCHEDULES))
    p.add_argument("--pp-microbatches", type=int, help="micro-batches per pipeline step (default 2 x stages)")
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


def _add_sequence_arguments(p: argparse.ArgumentParser) -> None:
    """What a sequence is and what its activations keep: length, positions, batch, checkpointing."""
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument(
        "--rope-scaling",
        default="none",
        choices=list(ROPE_SCALINGS),
        help="stretch the rotary embeddings past the model's positions (model.rope_scaling; yarn for Qwen3)",
    )
    p.add_argument("--rope-factor", type=float, default=0.0, help="with --rope-scaling: the factor (> 1)")
    p.add_argument(
        "--mlp-tiles", type=int, default=0, help="the MLP in N checkpointed sequence slices (model.mlp_tiles)"
    )
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per forward on a GPU (default 1)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    p.add_argument(
        "--label-tokens", type=int, default=256, help="loss positions per sequence (default 256: a summary)"
    )
    p.add_argument(
        "--activation-checkpointing",
        nargs="?",
        const="full",
        default="none",
        choices=list(CHECKPOINTING),
        help="what a layer keeps for backward (model.activation_checkpointing): full when given alone; "
        "selective recomputes the MLP only, offload moves each layer's input to host memory",
    )


# How `check_positions` spells its fix here: the plan's own flags.
PLAN_FLAGS = {
    "length": "--seq-len {n}",
    "scaling": "--rope-scaling {kind} --rope-factor {factor:g}",
    "factor": "--rope-factor {factor:g}",
}


def make_request(args: argparse.Namespace) -> Request:
    """Validate the command line and build the request (every error is a ConfigError)."""
    positive = {
        "--gpus": args.gpus,
        "--nodes": args.nodes,
        "--seq-len": args.seq_len,
        "--micro-batch": args.micro_batch,
        "--grad-accum": args.grad_accum,
        "--label-tokens": args.label_tokens,
        "--lora-rank": args.lora_rank,
    }
    for flag, value in positive.items():
        if value is None or value < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {value}.")
    if args.mlp_tiles < 0:
        raise ConfigError(f"--mlp-tiles must be 0 (the MLP whole) or more, got {args.mlp_tiles}.")
    if args.pp_microbatches is not None and args.pp_microbatches < 1:
        raise ConfigError(f"--pp-microbatches must be a positive integer, got {args.pp_microbatches}.")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu is a fraction of the peak, in (0, 1]; got {args.mfu}.")
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps must be a positive integer, got {args.steps}.")
    if not args.epochs > 0:
        raise ConfigError(f"--epochs must be positive, got {args.epochs:g}.")
    tokens = parse_tokens(args.tokens) if args.tokens is not None else None
    if args.gpu is None and args.gpu_mem is None:
        raise ConfigError(
            "Say what the GPUs are: --gpu (one of "
            + ", ".join(GPUS)
            + ") or --gpu-mem (e.g. 24GiB), or both."
        )
    memory = parse_bytes(args.gpu_mem) if args.gpu_mem else None
    gpu = find_gpu(args.gpu) if args.gpu else match_gpu(memory, args.interconnect) or generic_gpu(memory)
    memory = memory or gpu.memory
    try:
        overhead = parse_bytes(args.overhead)
    except ConfigError:
        raise ConfigError(f"--overhead {args.overhead!r} is not a memory size (e.g. 1GiB, 512MiB).") from None
    if overhead >= memory:
        raise ConfigError(
            f"--overhead {args.overhead} leaves nothing of --gpu-mem {args.gpu_mem or gpu.label}."
        )
    model = resolve_model(args.model)
    if args.rope_scaling != "none" and not args.rope_factor > 1:
        raise ConfigError(
            f"--rope-scaling {args.rope_scaling} needs --rope-factor > 1, got {args.rope_factor:g}."
        )
    rotary = scale_rope(dict(model.rotary), args.rope_scaling, args.rope_factor, model.name)
    check_positions(rotary, model.name, args.seq_len, PLAN_FLAGS)
    training = Training(
        method=args.method,
        precision=PRECISIONS[args.precision],
        lora_rank=args.lora_rank,
        dora=args.lora_variant == "dora",
        fp32_masters=args.master_weights == "fp32",
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        label_tokens=args.label_tokens,
        activation_checkpointing=args.activation_checkpointing,
        attention=args.attention,
        mlp_tiles=args.mlp_tiles,
        rope_scaling=args.rope_scaling,
        rope_factor=args.rope_factor if args.rope_scaling != "none" else 0.0,
    )
    return Request(
        model=model,
        training=training,
        gpu=gpu,
        gpu_memory=memory,
        gpus_per_node=args.gpus,
        nodes=args.nodes,
        intra=intra_node_link(gpu, args.interconnect, args.gpus),
        inter=inter_node_link(args.interconnect),
        grad_accum=args.grad_accum,
        pp_schedule=args.pp_schedule,
        pp_microbatches=args.pp_microbatches,
        mfu=args.mfu,
        overhead=overhead,
        run=RunLength(tokens, args.epochs, args.steps),
    )


def cmd_plan(args: argparse.Namespace) -> int:
    req = make_request(args)
    estimates = evaluate(req)
    rec = decide(req, estimates)
    (print_json if args.json else print_rich)(req, estimates, rec)
    return 0
