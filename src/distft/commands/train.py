"""`distft train`'s flags, and the settings they read: the defaults, then --config (or --resume's
saved config), then section.key=value overrides, then the flags. Read and checked here, field by
field, before the CLI imports the training machinery: a refused setting costs no torch import.
The rest (`--strategy auto`, the derived defaults, the strategy's checks) and the command itself
are `distft.train.command`'s."""

from __future__ import annotations

import argparse
from pathlib import Path

from distft.config import Config, load_config
from distft.config.choices import OBJECTIVES
from distft.errors import ConfigError
from distft.layout import SPECS, takers

TRAIN_FLAGS = {  # flag -> config field it sets
    "model": "model.name",
    "method": "train.method",
    "objective": "train.objective",
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
        "--config",
        help="TOML file with [model], [data], [lora], [optim], [train], [dpo], [moe], [parallel], [output]",
    )
    p.add_argument(
        "--model",
        help="preset (tiny, micro, llama-tiny, qwen3-4b, llama3-8b, ...), local directory, or hub id (e.g. Qwen/Qwen3-4B)",
    )
    p.add_argument(
        "--method",
        choices=["lora", "qlora", "full"],
        help="LoRA adapters on a frozen base, the same on a 4-bit NF4 base "
        f"({', '.join(takers('qlora'))}), or full finetuning",
    )
    p.add_argument(
        "--objective",
        choices=OBJECTIVES,
        help="sft (the answers' token loss), or a preference objective: dpo, orpo (pairs of answers), "
        "kto (answers labelled desirable or not) (docs/preference.md; settings in [dpo])",
    )
    p.add_argument(
        "--data",
        help="sample (bundled meetings), sample-pairs (them as preference pairs), sample-long (whole 4k-28k-token meetings), a .jsonl/.parquet/.csv file, or a hub dataset id",
    )
    p.add_argument("--max-steps", type=int, help="optimizer steps")
    p.add_argument("--out", help="run directory for adapter/, metrics.jsonl and config.toml")
    p.add_argument(
        "--strategy",
        metavar="NAME",
        help=f"how the model is split across processes: {', '.join(SPECS)} (docs/ has a page for each), "
        "or auto: the planner's choice for --nproc and this machine's memory (docs/plan.md)",
    )
    _add_launch_flags(p)
    p.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="config overrides, e.g. optim.lr=1e-4"
    )


def _add_launch_flags(p: argparse.ArgumentParser) -> None:
    """Where and how the run is launched: processes, nodes, restarts, and what runs before training."""
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
    p.add_argument(
        "--force",
        action="store_true",
        help="launch a run the plan says does not fit in memory (refused without this flag)",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (TOML: defaults, --config, overrides, flags and what is derived) and stop",
    )
    p.add_argument("--no-resume", action="store_true", help="start over even if --out holds a checkpoint")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the finished run in --out (refused without this flag)",
    )


def train_settings(args: argparse.Namespace) -> Config:
    """The settings the flags ask for, each field checked (`distft.config.load_config`): a bad
    value, an unknown key or a malformed --config is a ConfigError here."""
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
    return load_config(config_file, [*args.overrides, *flags], run=bool(args.resume) and not args.config)
