"""`distft` command line: train, infer, eval, plan and bench.

Every user error (a bad config, an impossible strategy/model combination, a malformed dataset
row, an output directory that cannot take the run) is checked here, before any worker process is
launched, and reported as one paragraph with exit code 2. A failure during training (a diverged
step, a collective that timed out, a checkpoint that could not be written) is one paragraph with
exit code 1. A multi-process run re-launches this same command under torchrun, once per rank.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from distft import bench, faults, plan
from distft.config import Config, load_config, to_toml
from distft.data import ChatFormatter, load_rows, load_tokenizer, tokenize_rows
from distft.distributed import exit_worker, launched_by_torchrun
from distft.errors import ConfigError, TrainingError
from distft.infer import evaluate_run, held_out_meeting, load_trained, summarize
from distft.io.checkpoint import check_resume
from distft.io.preflight import check_output_dir
from distft.model import is_preset, model_config
from distft.parallel import STRATEGIES, check_config, check_model
from distft.train import train
from distft.train.metrics import START_ENV

EXIT_FAILURE = 1
EXIT_USAGE = 2


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
}


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="finetune a model (LoRA or full) with any strategy",
        description="Finetune Qwen3 on meeting transcripts. With no arguments: the tiny preset on the "
        "bundled sample meetings, on CPU, in a few minutes. Settings come from the defaults, then "
        "--config, then section.key=value overrides, then the flags below.",
    )
    p.add_argument(
        "--config", help="TOML file with [model], [data], [lora], [optim], [train], [parallel], [output]"
    )
    p.add_argument(
        "--model", help="preset (tiny, micro, qwen3-4b, ...), local directory, or hub id (e.g. Qwen/Qwen3-4B)"
    )
    p.add_argument(
        "--method",
        choices=["lora", "qlora", "full"],
        help="LoRA adapters on a frozen base, the same on a 4-bit NF4 base (single, ddp, fsdp, zero2), "
        "or full finetuning",
    )
    p.add_argument("--data", help="sample (bundled meetings), a .jsonl/.parquet file, or a hub dataset id")
    p.add_argument("--max-steps", type=int, help="optimizer steps")
    p.add_argument("--out", help="run directory for adapter/, metrics.jsonl and config.toml")
    p.add_argument(
        "--strategy",
        metavar="NAME",
        help=f"how the model is split across processes: {', '.join(STRATEGIES)} (docs/ has a page for each)",
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
        "--resume", metavar="DIR", help="continue the run in DIR from its latest checkpoint, with its config"
    )
    p.add_argument("--no-resume", action="store_true", help="start over even if --out holds a checkpoint")
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
    config_file = args.config
    if args.resume:
        run = Path(args.resume)
        if not (run / "config.toml").is_file():
            raise ConfigError(f"--resume {run}: no config.toml there; it is not a distft run directory.")
        config_file = config_file or run / "config.toml"
        flags.append(f"output.dir={run}")
    cfg = load_config(config_file, [*args.overrides, *flags])
    check_config(cfg)  # the strategy's checks: before anything is launched
    return cfg


def preflight(cfg: Config) -> None:
    """Everything that can be checked without training: devices, the output directory, the model
    architecture and every data row."""

    if cfg.train.device == "cuda" and _cuda_count() == 0:
        raise ConfigError(
            "train.device=cuda, but this machine has no CUDA device; use train.device=cpu or auto."
        )
    on_cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and _cuda_count() > 0)
    if on_cuda and cfg.parallel.nproc > _cuda_count():
        raise ConfigError(
            f"--nproc {cfg.parallel.nproc} asks for more processes than the {_cuda_count()} GPU(s) on this "
            "node; each process needs its own GPU."
        )
    check_resume(cfg)
    architecture = model_config(cfg.model.name)
    check_model(cfg, architecture)
    check_output_dir(cfg, architecture)
    formatter = ChatFormatter(load_tokenizer(None if is_preset(cfg.model.name) else cfg.model.name), cfg.data)
    for split in load_rows(cfg.data, seed=cfg.train.seed).values():
        tokenize_rows(split, formatter)


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def torchrun_command(cfg: Config, config_file: str) -> list[str]:
    """`distft train --config FILE` (the resolved config), once per rank, under PyTorch's launcher."""
    p = cfg.parallel
    # distft.launch is torchrun with a one-paragraph failure report instead of the agent's traceback.
    cmd = [
        sys.executable,
        "-m",
        "distft.launch",
        f"--nproc-per-node={p.nproc}",
        f"--max-restarts={p.max_restarts}",
    ]
    if p.nnodes == 1:
        cmd.append("--standalone")  # picks a free port on this machine
    else:
        host, _, port = p.rdzv_endpoint.rpartition(":")
        cmd += [
            f"--nnodes={p.nnodes}",
            f"--node-rank={p.node_rank}",
            f"--master-addr={host}",
            f"--master-port={port}",
        ]
    return [*cmd, "-m", "distft.cli", "train", "--config", config_file]


def cmd_train(args: argparse.Namespace) -> int:

    cfg = config_from_args(args)
    if not launched_by_torchrun():
        preflight(cfg)
        if STRATEGIES[cfg.parallel.strategy].distributed:
            with tempfile.TemporaryDirectory(prefix="distft-launch-") as tmp:
                config_file = os.path.join(tmp, "config.toml")
                with open(config_file, "w", encoding="utf-8") as f:
                    f.write(to_toml(cfg))
                return subprocess.call(torchrun_command(cfg, config_file))
    train(cfg, hooks=faults.from_environment())  # test-only fault injection, off unless DISTFT_FAULT_*
    return 0


# ---------------------------------------------------------------------------------------------
# infer / eval
# ---------------------------------------------------------------------------------------------


def add_infer_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "infer",
        help="summarise a meeting with a trained adapter",
        description="Load base model + adapter and generate a summary. With no --input: a "
        "held-out meeting from the run's validation split.",
    )
    p.add_argument("--run", help="run directory written by `distft train`")
    p.add_argument("--adapter", help="a PEFT adapter directory (instead of --run)")
    p.add_argument(
        "--model", help="base model for --adapter (default: the adapter's base_model_name_or_path)"
    )
    p.add_argument("--input", help="transcript file, or - for standard input")
    p.add_argument("--max-new-tokens", type=int, default=128, help="longest summary to generate (tokens)")


def cmd_infer(args: argparse.Namespace) -> int:
    loaded = load_trained(run=args.run, adapter=args.adapter, model=args.model)
    if args.input == "-":
        transcript = sys.stdin.read()
    elif args.input:
        if not os.path.isfile(args.input):
            raise ConfigError(f"--input {args.input} does not exist.")
        with open(args.input, encoding="utf-8") as f:
            transcript = f.read()
    else:
        transcript = held_out_meeting(loaded.cfg)
        print("--- held-out meeting (first lines) ---")
        print("\n".join(transcript.splitlines()[:6]) + "\n...")
    print("--- generated summary ---")
    print(summarize(loaded, transcript, args.max_new_tokens))
    return 0


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="validation loss and ROUGE-L, base model vs finetuned",
        description="Score the base model and the finetuned one on the run's validation split.",
    )
    p.add_argument("--run", required=True, help="run directory written by `distft train`")
    p.add_argument("--rows", type=int, default=16, help="validation meetings to score")
    p.add_argument("--max-new-tokens", type=int, default=96, help="longest generated summary (tokens)")


def cmd_eval(args: argparse.Namespace) -> int:

    scores = evaluate_run(args.run, args.rows, args.max_new_tokens)
    table = Table("model", "validation loss", "ROUGE-L", title=f"{args.run}: {args.rows} validation meetings")
    for name, s in scores.items():
        table.add_row(name, f"{s['loss']:.4f}", f"{s['rougeL']:.4f}")
    Console().print(table)
    return 0


# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distft", description="Finetune Qwen3 with every parallel strategy."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    add_infer_parser(sub)
    add_eval_parser(sub)
    plan.add_plan_parser(sub)
    bench.add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
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
        "infer": lambda: cmd_infer(args),
        "eval": lambda: cmd_eval(args),
        "bench": lambda: bench.cmd_bench(args),
        "plan": lambda: plan.cmd_plan(args),
    }
    try:
        code = handlers[args.command]()
    except ConfigError as err:
        print(f"distft {args.command}: error: {err}", file=sys.stderr)
        code = EXIT_USAGE
    except TrainingError as err:
        if err.every_rank or os.environ.get("RANK", "0") == "0":
            print(f"distft {args.command}: error: {err}", file=sys.stderr)
        code = EXIT_FAILURE
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank under torchrun ends here, hard
        exit_worker(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
