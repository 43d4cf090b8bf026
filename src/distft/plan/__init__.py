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
- `report`: the rich table and the JSON document;
- here: `make_request` checks `distft plan`'s flags (`distft.commands.plan`), or reads the training
  config they name (`run_config`: --config and section.key=value, resolved as `distft train`
  resolves it, the one path from a config to what the planner models, `auto.request_for`), and
  `cmd_plan` answers.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from distft.config import Config, load_config
from distft.errors import ConfigError
from distft.measure.gpus import find_gpu
from distft.model.positions import check_positions, scale_rope
from distft.parallel import check_config
from distft.plan.auto import (
    complete,
    data_label_tokens,
    dry_run,
    parallelism_of,
    predict,
    request_for,
    try_predict,
)
from distft.plan.decide import decide
from distft.plan.estimate import Request, estimate, evaluate
from distft.plan.fits import check_fits, truncation_warning
from distft.plan.hardware import (
    generic_gpu,
    inter_node_link,
    intra_node_link,
    match_gpu,
    parse_bytes,
)
from distft.plan.inputs import PRECISIONS, Training
from distft.plan.model_spec import resolve_model
from distft.plan.report import print_json, print_rich
from distft.plan.run_line import run_command
from distft.plan.timing import RunLength, parse_tokens

# What the other layers use: `distft train`'s checks and prediction, the tests' requests.
__all__ = [
    "check_fits",
    "complete",
    "dry_run",
    "evaluate",
    "make_request",
    "predict",
    "run_command",
    "truncation_warning",
    "try_predict",
]


# How `check_positions` spells its fix here: the plan's own flags.
POSITION_FIXES = {
    "length": "--seq-len {n}",
    "scaling": "--rope-scaling {kind} --rope-factor {factor:g}",
    "factor": "--rope-factor {factor:g}",
}


def check_numbers(args: argparse.Namespace) -> None:
    """The numeric flags in range (a ConfigError naming the flag otherwise)."""
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
    if not args.expert_imbalance >= 1:
        raise ConfigError(
            f"--expert-imbalance is the busiest rank's share over the mean, 1 or more; got {args.expert_imbalance:g}."
        )
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu is a fraction of the peak, in (0, 1]; got {args.mfu}.")
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps must be a positive integer, got {args.steps}.")
    if not args.epochs > 0:
        raise ConfigError(f"--epochs must be positive, got {args.epochs:g}.")


def run_config(args: argparse.Namespace) -> Config | None:
    """The training config the plan is asked about: --config, its section.key=value overrides and
    the flags given on top (`commands.plan.PLAN_FLAGS`, in `args.flag_settings`), resolved and checked as `distft train` resolves them
    (`--strategy auto`, the derived defaults); None when the plan is asked with flags alone."""
    if args.config is None and not args.overrides:
        return None
    given = [
        f"{key}={getattr(args, flag)}"
        for flag, key in args.flag_settings.items()
        if getattr(args, flag) is not None
    ]
    cfg = load_config(args.config, [*args.overrides, *given])
    for line in complete(cfg):
        print(line, file=sys.stderr)
    check_config(cfg)
    return cfg


def config_request(args: argparse.Namespace, cfg: Config) -> Request:
    """The request a training config asks (`auto.request_for`, what its run predicts): on this
    machine's device, or on --gpu / --gpu-mem with --interconnect where given; the data's labelled
    positions per row where it can be read here (else --label-tokens, or 256); --precision,
    --label-tokens, --mfu and the run's length (--tokens, --epochs, --steps: the config's
    train.max_steps by default) on top."""
    shape = check_config(cfg)
    labels = args.label_tokens or data_label_tokens(cfg)  # the data's, as its run measures them
    req, _ = request_for(cfg, shape.micro_batch_size, shape.accumulation_steps, labels)
    if args.gpu or args.gpu_mem:
        memory = parse_bytes(args.gpu_mem) if args.gpu_mem else None
        gpu = find_gpu(args.gpu) if args.gpu else match_gpu(memory, args.interconnect) or generic_gpu(memory)
        memory = memory or gpu.memory
        intra = intra_node_link(gpu, args.interconnect, req.gpus_per_node)
        inter, overhead = inter_node_link(args.interconnect), parse_bytes(args.overhead)
        training = replace(req.training, device="cuda")  # that GPU's kernels (`plan.attention`)
        req = replace(req, training=training, gpu=gpu, gpu_memory=memory, intra=intra, inter=inter)
        req = replace(req, overhead=overhead)
    if args.precision:
        req = replace(req, training=replace(req.training, precision=PRECISIONS[args.precision]))
    tokens = parse_tokens(args.tokens) if args.tokens is not None else None
    steps = args.steps or (None if tokens else cfg.train.max_steps)
    return replace(
        req, mfu=args.mfu, pp_microbatches=args.pp_microbatches, run=RunLength(tokens, args.epochs, steps)
    )


def make_request(args: argparse.Namespace, cfg: Config | None = None) -> Request:
    """Validate the command line and build the request (every error is a ConfigError): from the
    training config it names (`run_config`), else from the flags and the planner's defaults."""
    if cfg is not None:
        return config_request(args, cfg)
    for flag, default in args.flag_defaults.items():
        if getattr(args, flag) is None:
            setattr(args, flag, default)
    check_numbers(args)
    tokens = parse_tokens(args.tokens) if args.tokens is not None else None
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
    if model.moe and args.method == "qlora":
        raise ConfigError(
            f"--method qlora cannot plan {model.name}: its NF4 base quantizes Linear layers, and the experts "
            "(nearly all of the weights) are fused parameter stacks. Use --method lora."
        )
    if args.rope_scaling != "none" and not args.rope_factor > 1:
        raise ConfigError(
            f"--rope-scaling {args.rope_scaling} needs --rope-factor > 1, got {args.rope_factor:g}."
        )
    rotary = scale_rope(dict(model.rotary), args.rope_scaling, args.rope_factor, model.name)
    check_positions(rotary, model.name, args.seq_len, POSITION_FIXES)
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
        expert_imbalance=args.expert_imbalance,
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
        cp_method=args.cp_method,
        overhead=overhead,
        run=RunLength(tokens, args.epochs, args.steps),
    )


def cmd_plan(args: argparse.Namespace) -> int:
    cfg = run_config(args)
    req = make_request(args, cfg)
    estimates = evaluate(req)
    if cfg is not None:  # the config's own strategy in its own layout: what its run predicts
        layout = parallelism_of(cfg, req.pp_schedule)
        estimates[cfg.parallel.strategy] = estimate(req, layout, cfg.parallel.strategy)
    rec = decide(req, estimates)
    (print_json if args.json else print_rich)(req, estimates, rec)
    return 0
