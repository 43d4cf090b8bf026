"""`distft --help`, `--version`, `config`, every command's --help and a refused setting answer
without importing torch, transformers, peft or datasets: the parser is `distft.commands`' and a
command's module is imported when it runs (`distft.cli.COMMANDS`). Each case runs the real entry
point, `python -X importtime -m distft.cli ARGS`, and reads the modules it imported from
importtime's lines. No timing is asserted here (docs/bench.md, "Command start-up", measures it).

The tables the help texts list (strategies, the planner's precisions, schedules and links,
bench's studies) live in torch-free modules that the runtime and the planner read too."""

from __future__ import annotations

import subprocess
import sys

import pytest

import distft
from distft import cli
from distft.commands import bench as bench_flags

HEAVY = ("torch", "transformers", "peft", "datasets")


def run_cli(*args: str) -> tuple[int, str, str, set[str]]:
    """Exit code, stdout, stderr (importtime's lines removed) and the top-level packages imported."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "distft.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = proc.stderr.splitlines()
    imported = {
        line.rsplit("|", 1)[1].strip().split(".")[0] for line in lines if line.startswith("import time:")
    }
    stderr = "".join(f"{line}\n" for line in lines if not line.startswith("import time:"))
    return proc.returncode, proc.stdout, stderr, imported


def heavy(imported: set[str]) -> list[str]:
    return sorted(imported & set(HEAVY))


COMMAND_HELP = [[], *([name] for name in cli.COMMANDS), ["data", "preview"]]


@pytest.mark.parametrize("command", COMMAND_HELP, ids=[" ".join(c) or "distft" for c in COMMAND_HELP])
def test_every_help_is_light(command):
    code, out, err, imported = run_cli(*command, "--help")
    assert (code, err) == (0, "")
    assert out.startswith(f"usage: distft {' '.join(command)}".rstrip())
    if len(command) < 2:  # the epilog of distft's and each command's --help
        assert "`distft config` lists every one" in out
    assert heavy(imported) == []


def test_version_is_light():
    code, out, err, imported = run_cli("--version")
    assert (code, out, err) == (0, f"distft {distft.__version__}\n", "")
    assert heavy(imported) == []


def test_config_is_light():
    code, out, err, imported = run_cli("config", "lr")
    assert (code, err) == (0, "")
    assert out.startswith("optim.lr = ")
    assert heavy(imported) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["optim.lr=abc"], "distft train: error: `optim.lr` must be a number, got 'abc'.\n"),
        (
            ["nosuch.key=1"],
            "distft train: error: Unknown config section `nosuch`. Valid: data, dpo, lora, model, moe, optim, output, "
            "parallel, train.\n",
        ),
        (["--config", "BAD"], "is not valid TOML: Expected ']' at the end of a table declaration"),
    ],
    ids=["bad value", "unknown key", "malformed toml"],
)
def test_a_refused_setting_is_light(args, message, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim\nlr = 1\n")
    code, out, err, imported = run_cli("train", *[str(bad) if a == "BAD" else a for a in args])
    assert (code, out) == (2, "")
    assert message in err and len(err.splitlines()) == 1, err
    assert heavy(imported) == []


def test_export_flags_that_do_not_go_together_are_light():
    code, out, err, imported = run_cli("export", "--run", "r", "--out", "o", "--adapter-only")
    assert (code, out) == (2, "")
    assert err == (
        "distft export: error: --adapter-only is for --format gguf; a transformers export takes "
        "--dtype bfloat16 or float32.\n"
    )
    assert heavy(imported) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "qwen3-4b"], "Say what the GPUs are: --gpu (one of rtx4090, "),
        (["--gpu", "h100"], "Say what to plan: --model"),
        (["--model", "qwen3-4b", "--gpu", "tpu-v5"], "Unknown --gpu 'tpu-v5'; known profiles: "),
    ],
)
def test_plan_flags_that_say_too_little_are_light(args, message):
    code, out, err, imported = run_cli("plan", *args)
    assert (code, out) == (2, "")
    assert err.startswith(f"distft plan: error: {message}") and len(err.splitlines()) == 1, err
    assert heavy(imported) == []


def test_a_command_imports_its_module_when_it_runs():
    """A setting the strategy refuses is checked after the import, as before: one line, exit 2."""
    code, _, err, imported = run_cli("train", "--model", "micro", "--strategy", "nosuch")
    assert code == 2 and err.startswith("distft train: error: ") and len(err.splitlines()) == 1, err
    assert "torch" in imported


# ---- the command table and the light copies ------------------------------------------------------


def test_the_command_table_names_every_command_and_its_function():
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert list(cli.COMMANDS) == list(sub.choices)
    for name in cli.COMMANDS:
        assert callable(cli.command(name)), name
    from distft.train.command import config_from_args

    assert cli.config_from_args is config_from_args  # `from distft.cli import config_from_args` still works


def test_the_tables_the_help_lists_are_their_sources_not_copies():
    """The strategies, precisions, schedules, links and studies the flags offer are read from
    torch-free modules the runtime, the planner and bench read too: one table each."""
    from distft.bench import study
    from distft.config.choices import PIPELINE_SCHEDULES, PLANNED_SCHEDULES
    from distft.config.precision import PRECISIONS
    from distft.layout import SPECS
    from distft.measure.gpus import INTERCONNECTS, LINKS
    from distft.parallel import STRATEGIES
    from distft.parallel.pipeline import SCHEDULES
    from distft.plan import hardware, inputs

    commands = next(a for a in cli.build_parser()._actions if a.dest == "command").choices

    def choices(command: str, flag: str) -> list | None:
        return next(a.choices for a in commands[command]._actions if flag in a.option_strings)

    def help_of(command: str, flag: str) -> str:
        return next(a.help for a in commands[command]._actions if flag in a.option_strings)

    assert list(STRATEGIES) == list(SPECS)
    assert all(name in help_of("train", "--strategy") for name in SPECS)
    assert inputs.PRECISIONS is PRECISIONS and list(choices("plan", "--precision")) == list(PRECISIONS)
    assert hardware.LINKS is LINKS and choices("plan", "--interconnect") == INTERCONNECTS
    assert choices("plan", "--pp-schedule") == PLANNED_SCHEDULES and set(PIPELINE_SCHEDULES) == set(SCHEDULES)
    assert study.STUDIES is bench_flags.STUDIES and list(choices("bench", "--study")) == list(study.STUDIES)


def test_a_command_is_imported_with_the_collector_paused_and_its_imports_frozen():
    """`distft.cli.command`: no collection runs while a command's module (torch, transformers,
    peft) imports; then the collector is on again, and what the imports made is out of its reach."""
    probe = (
        "import gc\n"
        "from distft import cli\n"
        "collections = []\n"
        "gc.callbacks.append(lambda phase, info: collections.append(info) if phase == 'start' else None)\n"
        "cli.command('plan')\n"
        "print(len(collections), gc.isenabled(), gc.get_freeze_count() > 100_000)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (0, "0 True True\n"), proc.stderr
