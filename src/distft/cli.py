"""`distft` command line: train, data, infer, eval, export, plan, bench and doctor (data preview:
`distft.train.preview`; infer and eval: `distft.infer.commands`; doctor: `distft.doctor`).

Every user error (a bad config, an impossible strategy/model combination, a malformed dataset
row, an output directory that cannot take the run) is checked here, before any worker process is
launched, and reported as one paragraph with exit code 2. A failure during training (a diverged
step, a collective that timed out, a checkpoint that could not be written) is one paragraph with
exit code 1. A multi-process run re-launches this same command under torchrun, once per rank.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import distft.signals  # noqa: F401 (first: a Ctrl-C during the imports below is one line, `starting`)
from distft import bench, plan, signals
from distft.config import Config, load_config, to_toml
from distft.distributed import exit_worker, launched_by_torchrun, pick_device
from distft.doctor import add_doctor_parser, cmd_doctor
from distft.errors import ConfigError
from distft.exits import run_command
from distft.export import EXPORT_DTYPES, export_run
from distft.health import print_network_warnings
from distft.health.cuda import check_bf16
from distft.infer import add_eval_parser, add_infer_parser, cmd_eval, cmd_infer  # the infer/eval commands
from distft.io.checkpoint import check_resume
from distft.io.lock import run_lock
from distft.io.preflight import check_finished_run, check_output_dir, check_writable
from distft.launch import launch_ranks
from distft.model.build import architecture, check_weight_files
from distft.parallel import STRATEGIES, check_config, check_model, ignored_settings
from distft.parallel.derive import notes_for_ranks, read_rank_notes
from distft.parallel.pipeline.calibrate import calibrate
from distft.text import plural
from distft.train import train
from distft.train.hooks import from_environment as hooks_from_environment
from distft.train.metrics import START_ENV
from distft.train.optim import check_optimizer
from distft.train.prepare import prepare_data, resolve_local_paths
from distft.train.preview import add_data_parser, cmd_data
from distft.train.tracking import check_trackers

# ---------------------------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------------------------

TRAIN_FLAGS = {  # flag -> config field it sets
    "model": "model.name",
    "method": "train.method",
    "data": "data.source",
    "max_steps": "train.max_steps",
    "out": "output.dir",
    "strategy": "parallel.strategy",
    "nproc": "parallel.nproc",
    "nnodes": "parallel.nnodes",
    "node_rank": "parallel.node_rank",
    "rdzv_endpoint": "parallel.rdzv_endpoint",
    "checkpoint_every": "output.checkpoint_every",
    "max_restarts": "parallel.max_restarts",
    "allow_mixed": "parallel.allow_mixed",
}


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="finetune a model (LoRA or full) with any strategy",
        description="Finetune Qwen3, Llama 3, Qwen2.5 or Mistral on meeting transcripts. With no arguments: the tiny preset on the "
        "bundled sample meetings, on CPU, in a few minutes. Settings come from the defaults, then "
        "--config, then section.key=value overrides, then the flags below.",
    )
    p.add_argument(
        "--config", help="TOML file with [model], [data], [lora], [optim], [train], [parallel], [output]"
    )
    p.add_argument(
        "--model",
        help="preset (tiny, micro, llama-tiny, qwen3-4b, llama3-8b, ...), local directory, or hub id (e.g. Qwen/Qwen3-4B)",
    )
    p.add_argument(
        "--method",
        choices=["lora", "qlora", "full"],
        help="LoRA adapters on a frozen base, the same on a 4-bit NF4 base "
        f"({', '.join(s for s, c in STRATEGIES.items() if c.supports_qlora)}), or full finetuning",
    )
    p.add_argument(
        "--data",
        help="sample (bundled meetings), sample-long (whole 4k-28k-token meetings), a .jsonl/.parquet file, or a hub dataset id",
    )
    p.add_argument("--max-steps", type=int, help="optimizer steps")
    p.add_argument("--out", help="run directory for adapter/, metrics.jsonl and config.toml")
    p.add_argument(
        "--strategy",
        metavar="NAME",
        help=f"how the model is split across processes: {', '.join(STRATEGIES)} (docs/ has a page for each), "
        "or auto: the planner's choice for --nproc and this machine's memory (docs/plan.md)",
    )
    p.add_argument(
        "--nproc", type=int, help="processes per node; above 1 the run is launched through torchrun"
    )
    p.add_argument("--nnodes", type=int, help="number of nodes (run the same command on each)")
    p.add_argument("--node-rank", type=int, help="this node's index, 0..nnodes-1")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of node 0, for multi-node runs")
    p.add_argument("--checkpoint-every", type=int, help="write a resumable checkpoint every N steps")
    p.add_argument(
        "--max-restarts",
        type=int,
        help="restart every rank up to R times after one fails (torchrun's elastic agent); each restart "
        "resumes from the latest checkpoint",
    )
    p.add_argument(
        "--allow-mixed",
        action="store_const",
        const="true",
        help="run even if ranks differ in device or software versions (a warning instead of an error)",
    )
    p.add_argument(
        "--resume", metavar="DIR", help="continue the run in DIR from its latest checkpoint, with its config"
    )
    p.add_argument(
        "--calibrate",
        metavar="RUN",
        help="cut the pipeline's stages (parallel.pp_split) by the pass times RUN measured: its "
        "pipeline_timeline.json, which every pipeline run writes (docs/pp.md)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="every check, the batch and the plan's memory estimate; no training",
    )
    p.add_argument("--no-resume", action="store_true", help="start over even if --out holds a checkpoint")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the finished run in --out (refused without this flag)",
    )
    p.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="config overrides, e.g. optim.lr=1e-4"
    )


def config_from_args(args: argparse.Namespace) -> Config:
    flags = [
        f"{field}={getattr(args, flag)}"
        for flag, field in TRAIN_FLAGS.items()
        if getattr(args, flag, None) is not None
    ]
    if args.no_resume:
        flags.append("output.resume=false")
    if args.overwrite:
        flags.append("output.overwrite=true")
    config_file = args.config
    if args.resume:
        run = Path(args.resume)
        if not (run / "config.toml").is_file():
            raise ConfigError(f"--resume {run}: no config.toml there; it is not a distft run directory.")
        config_file = config_file or run / "config.toml"
        # The saved config may say resume=false or overwrite=true (how that run began): --resume continues.
        flags += [f"output.dir={run}", "output.resume=true", "output.overwrite=false"]
    cfg = load_config(config_file, [*args.overrides, *flags], run=bool(args.resume) and not args.config)
    resolve_local_paths(cfg)
    if launched_by_torchrun():  # the launching command derived and predicted: its notes
        read_rank_notes(cfg)
    else:  # `--strategy auto` and the defaults that compose with the strategy (`parallel.derive`)
        for line in plan.complete(cfg):
            print(line, flush=True)
    check_config(cfg)  # the strategy's checks: before anything is launched
    if getattr(args, "calibrate", None):  # the pipeline's cut from a run's measured stage times
        calibration = calibrate(cfg, args.calibrate, args.overrides)
        calibration.apply(cfg)
        print(calibration.line(), flush=True)
    return cfg


def preflight(cfg: Config, resuming: bool = False) -> float | None:
    """Everything that can be checked without training: devices, the output directory, the model
    architecture and every data row (their mean labelled positions returned)."""

    if cfg.train.device == "cuda" and _cuda_count() == 0:
        raise ConfigError(
            "train.device=cuda, but this machine has no CUDA device; use train.device=cpu or auto."
        )
    on_cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and _cuda_count() > 0)
    if on_cuda and cfg.parallel.nproc > _cuda_count():
        raise ConfigError(
            f"--nproc {cfg.parallel.nproc} asks for more processes than the {plural(_cuda_count(), 'GPU')} on this "
            "node; each process needs its own GPU."
        )
    if on_cuda:
        check_bf16(cfg.model, cfg.parallel.nproc)  # bfloat16 needs compute capability 8.0
    check_resume(cfg)
    check_trackers(cfg)  # output.report_to: each tracker's library is installed
    check_optimizer(cfg, "cuda" if on_cuda else "cpu")  # adamw-8bit: bitsandbytes, and it runs here
    check_finished_run(cfg, resuming)  # after check_resume: a foreign config is named first
    check_weight_files(cfg.model)
    model = architecture(cfg.model)  # rotary embeddings as model.rope_scaling stretches them
    check_model(cfg, model)
    check_output_dir(cfg, model)
    return prepare_data(cfg)


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cmd_train(args: argparse.Namespace) -> int:

    cfg = config_from_args(args)
    if launched_by_torchrun():  # a rank: the command that launched it checked everything
        return trained(cfg)
    for line in ignored_settings(cfg):  # valid, but does nothing under this strategy
        print(f"distft train: warning: {line}", file=sys.stderr)
    check_writable(Path(cfg.output.dir))
    if args.dry_run:  # no lock either: nothing is written to the run directory
        cfg.prediction = plan.try_predict(cfg, preflight(cfg, resuming=args.resume is not None))
        return plan.dry_run(cfg)
    # One writer per run directory, checks included; node 0 takes it for a multi-node run (the
    # others may share its filesystem).
    lock = run_lock(Path(cfg.output.dir)) if cfg.parallel.node_rank == 0 else contextlib.nullcontext()
    with lock:
        labels = preflight(cfg, resuming=args.resume is not None)
        cfg.prediction = plan.try_predict(cfg, labels)  # beside the measured figures in ranks.json
        if not STRATEGIES[cfg.parallel.strategy].distributed:
            return trained(cfg)
        on_cuda = pick_device(cfg.train.device).type == "cuda"
        parallel = cfg.parallel
        print_network_warnings(
            "nccl" if on_cuda else "gloo", parallel.nproc, parallel.nnodes, parallel.rdzv_endpoint
        )
        with tempfile.TemporaryDirectory(prefix="distft-launch-") as tmp:
            config_file = os.path.join(tmp, "config.toml")
            with open(config_file, "w", encoding="utf-8") as f:
                f.write(to_toml(cfg))
            # CPU ranks are forked from this process, which has imported distft (`distft.launch`).
            with signals.deferred(), notes_for_ranks(cfg):  # signals: the ranks and the agent act on them
                return launch_ranks(cfg.parallel, ["train", "--config", config_file], fork=not on_cuda)


def trained(cfg: Config) -> int:
    """Train in this process (the run, or one rank of it): 0, or the exit code of the signal that
    stopped it after the line saying where (`distft.signals`)."""
    result = train(cfg, hooks=hooks_from_environment())  # DISTFT_HOOKS (how tests inject faults), else none
    if result.stopped_by is None:
        return 0
    if os.environ.get("RANK", "0") == "0":  # every rank stopped after the same step
        print(result.stopped_line(cfg.train.max_steps), file=sys.stderr, flush=True)
    return signals.exit_code(result.stopped_by)


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="merge a run's adapter into its base and write one transformers model",
        description="Write a finished run as a plain transformers model (config.json + safetensors), "
        "the LoRA/QLoRA adapter merged into its base, with the tokenizer, its chat template and a model "
        "card; loadable with AutoModelForCausalLM/AutoTokenizer.from_pretrained. See docs/export.md.",
    )
    p.add_argument("--run", required=True, help="run directory written by `distft train`")
    p.add_argument("--out", required=True, help="directory to write (new, empty, or an earlier export)")
    p.add_argument("--dtype", choices=EXPORT_DTYPES, default="bfloat16", help="weight dtype of the export")
    p.add_argument("--push-to-hub", metavar="REPO", help="also upload to this hub repository (user/name)")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")


def cmd_export(args: argparse.Namespace) -> int:
    out = export_run(args.run, args.out, args.dtype, args.push_to_hub, args.private)
    print(f"exported {args.run} to {out} ({args.dtype})")
    if args.push_to_hub:
        print(f"uploaded to https://huggingface.co/{args.push_to_hub}")
    return 0


# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distft",
        description="Finetune Qwen3, Llama 3, Qwen2.5 and Mistral with every parallel strategy.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    add_data_parser(sub)
    add_infer_parser(sub)
    add_eval_parser(sub)
    add_export_parser(sub)
    plan.add_plan_parser(sub)
    bench.add_bench_parser(sub)
    add_doctor_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    signals.started()  # the imports are done: each command's own handling from here
    os.environ.setdefault(START_ENV, str(time.time()))  # start-up time is measured from here
    parser = build_parser()
    # Overrides may sit anywhere among the flags (`--model micro optim.lr=1e-3 --max-steps 5`);
    # argparse only takes positionals in one run, so the rest are collected here.
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    handlers: dict[str, Any] = {
        "train": lambda: cmd_train(args),
        "data": lambda: cmd_data(args),
        "infer": lambda: cmd_infer(args),
        "eval": lambda: cmd_eval(args),
        "export": lambda: cmd_export(args),
        "bench": lambda: bench.cmd_bench(args),
        "plan": lambda: plan.cmd_plan(args),
        "doctor": lambda: cmd_doctor(args),
    }
    # `distft train` stops at a step boundary on SIGINT/SIGTERM (`distft.signals`).
    with signals.handling() if args.command == "train" else contextlib.nullcontext():
        code = run_command(args.command, handlers[args.command])
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank under torchrun ends here, hard
        exit_worker(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
