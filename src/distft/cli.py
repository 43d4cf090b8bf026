"""`distft` command line: train, data, infer, eval, export, plan, bench, doctor and config.

The parser is light: every command's flags are `distft.commands`' (argparse and tables of names),
and `config` needs `distft.config` only. A command's own module is imported when it runs
(`COMMANDS`), so `distft --help`, `distft --version`, `distft config`, any command's --help and a
refused setting answer without importing torch, transformers or peft.

Every user error (a bad config, an impossible strategy/model combination, a malformed dataset
row, an output directory that cannot take the run) is checked before any worker process is
launched, and reported as one paragraph with exit code 2. A failure during training (a diverged
step, a collective that timed out, a checkpoint that could not be written) is one paragraph with
exit code 1. A multi-process run re-launches this same command under torchrun, once per rank.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import distft.signals  # first: a Ctrl-C until the command's imports are done is one line (`starting`)
from distft import signals
from distft.commands.bench import add_bench_parser
from distft.commands.data import add_data_parser
from distft.commands.doctor import add_doctor_parser
from distft.commands.export import add_export_parser
from distft.commands.infer import add_eval_parser, add_infer_parser
from distft.commands.plan import add_plan_parser
from distft.commands.train import add_train_parser, train_settings
from distft.config import Config
from distft.config.describe import SEE_SETTINGS, add_config_parser, flag_meant
from distft.exits import exit_worker, run_command

# Where each command runs: its module is imported when the command runs, the one import of distft
# inside a function (docs/architecture.md), so that no command pays for another's imports.
COMMANDS = {
    "train": "distft.train.command:cmd_train",
    "data": "distft.train.preview:cmd_data",
    "infer": "distft.infer.commands:cmd_infer",
    "eval": "distft.infer.commands:cmd_eval",
    "export": "distft.export_command:cmd_export",
    "plan": "distft.plan:cmd_plan",
    "bench": "distft.bench:cmd_bench",
    "doctor": "distft.doctor:cmd_doctor",
    "config": "distft.config.describe:cmd_config",
}


def command(name: str) -> Callable[..., int]:
    """The function that runs command `name`, its module imported now (`COMMANDS`), with Python's
    cyclic garbage collector paused meanwhile. torch, transformers and peft make hundreds of
    thousands of objects as they import, and every collection walks all of them again: `distft
    train`'s imports took 4.7 s with it running, 3.7 s paused (2 cores). What they made is then
    frozen out of it (`gc.freeze`): modules live as long as the process, so a later collection
    (set-up, the training loop) would only walk them again to find nothing."""
    module, _, function = COMMANDS[name].partition(":")
    collecting = gc.isenabled()
    gc.disable()
    try:
        return getattr(importlib.import_module(module), function)
    finally:
        gc.freeze()
        if collecting:
            gc.enable()


def __getattr__(name: str) -> Any:
    """`from distft.cli import config_from_args`: the train command's, imported when asked for."""
    if name == "config_from_args":
        return getattr(sys.modules[command("train").__module__], name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distft",
        description="Finetune Qwen3, Llama 3, Qwen2.5 and Mistral with every parallel strategy.",
    )
    parser.add_argument("--version", action="version", version=f"distft {distft.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    add_data_parser(sub)
    add_infer_parser(sub)
    add_eval_parser(sub)
    add_export_parser(sub)
    add_plan_parser(sub)
    add_bench_parser(sub)
    add_doctor_parser(sub)
    add_config_parser(sub)
    for p in (parser, *sub.choices.values()):  # every --help says where the settings are
        p.epilog = SEE_SETTINGS
    return parser


def _with_value(flag: str, argv: list[str]) -> str:
    """`--lr 1e-4` as `--lr=1e-4`: the value that follows a flag argparse did not know."""
    after = argv[argv.index(flag) + 1 : argv.index(flag) + 2] if flag in argv else []
    return f"{flag}={after[0]}" if "=" not in flag and after and not after[0].startswith("-") else flag


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The command line, overrides anywhere among the flags (`--model micro optim.lr=1e-3 --max-steps
    5`: argparse only takes positionals in one run, so the rest are collected here); a stray flag is
    answered with the setting it most likely meant."""
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if stray:
        meant = [m for e in stray if e.startswith("--") and (m := flag_meant(_with_value(e, argv)))]
        hint = (
            f" Did you mean {', '.join(meant)}? Settings are section.key=value (`distft config`)."
            if meant
            else ""
        )
        parser.error(f"unrecognized arguments: {' '.join(stray)}.{hint}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(build_parser(), sys.argv[1:] if argv is None else argv)
    code = run(args)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank under torchrun ends here, hard
        exit_worker(code)
    return code


def run(args: argparse.Namespace) -> int:
    """The command, its module imported first (a Ctrl-C meanwhile is one line, `signals.starting`).
    `distft train` reads and checks its settings before that import: a refused setting (a bad
    value, an unknown key, a malformed --config) answers without torch; so do flags another
    command's parser refuses together (its `check`)."""
    settings: Config | None = None
    if args.command == "train":

        def read_settings() -> int:
            nonlocal settings
            settings = train_settings(args)
            return 0

        if code := run_command("train", read_settings):
            return code
    elif (check := getattr(args, "check", None)) and (
        code := run_command(args.command, lambda: check(args) or 0)
    ):
        return code  # flags that do not go together (`distft.commands`)
    runs = command(args.command)
    signals.started()  # the imports are done: each command's own handling from here
    # `distft train` stops at a step boundary on SIGINT/SIGTERM (`distft.signals`).
    with signals.handling() if args.command == "train" else contextlib.nullcontext():
        return run_command(args.command, lambda: runs(args) if settings is None else runs(args, settings))


if __name__ == "__main__":
    sys.exit(main())
