"""`distft config` (`distft.config.describe`): every setting with its default and its docstring, a
word narrowing the list, a run's resolved config; `train --print-config`; a flag that names a
setting (`--lr`) answered with its key; every --help pointing at them. In-process, nothing trained."""

from __future__ import annotations

import dataclasses

import pytest

from distft.cli import build_parser, main
from distft.config import Config, load_config
from distft.config.describe import SEE_SETTINGS, flag_meant, settings
from distft.model.experts import experts_kernel


def test_every_setting_is_listed_with_its_default_and_a_docstring(capsys):
    keys = [
        f"{s.name}.{f.name}"
        for s in dataclasses.fields(Config)
        for f in dataclasses.fields(getattr(Config(), s.name))
    ]
    assert [s.key for s in settings()] == keys
    assert all(s.doc for s in settings()), [s.key for s in settings() if not s.doc]
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert all(f"\n{key} = " in f"\n{out}" for key in keys)
    assert (
        'model.name = "tiny"  (str)\n    A preset name' in out
        and "lora.rank = 16  (int)\n    LoRA rank r." in out
    )
    assert main(["config", "warmup"]) == 0  # a part of a key: every key holding it
    assert capsys.readouterr().out.startswith("optim.warmup_steps = 10  (int)\n")
    assert main(["config", "lr"]) == 0  # a key's name: that key alone
    assert capsys.readouterr().out.startswith("optim.lr = 0.01  (float)\n    Peak learning rate")
    assert main(["config", "nothing_by_this_name"]) == 2
    assert "No setting is named by 'nothing_by_this_name'" in capsys.readouterr().err


@pytest.mark.parametrize("word", ["data", "model", "lora", "target_modules", "report_to", "roles"])
def test_a_word_that_names_a_list_or_table_setting_lists_it(word, capsys):
    """Settings whose default is a list or a table (`lora.target_modules`, `data.roles`), alone or
    among their section's, are listed like any other."""
    assert main(["config", word]) == 0
    out = capsys.readouterr().out
    listed = [s for s in settings() if isinstance(s.default, list | dict) and word in s.key]
    assert listed and all(f"{s.key} = " in out for s in listed), out[:500]


def test_resolved_configs_of_a_run_to_be_and_of_a_run_done(tmp_path, capsys):
    assert main(["train", "--model", "Qwen/Qwen3-4B", "--max-steps", "5", "--print-config"]) == 0
    text = capsys.readouterr().out
    resolved = tmp_path / "run" / "config.toml"
    resolved.parent.mkdir()
    resolved.write_text(text.split("\n[model]", 1)[-1].join(["[model]", ""]) if "\n[model]" in text else text)
    cfg = load_config(resolved, run=True)
    assert (cfg.model.name, cfg.train.max_steps, cfg.optim.lr, cfg.optim.warmup_ratio) == (
        "Qwen/Qwen3-4B",
        5,
        2e-4,
        0.1,
    )
    assert main(["config", "--run", str(resolved.parent)]) == 0
    assert 'name = "Qwen/Qwen3-4B"' in capsys.readouterr().out
    assert main(["config", "--run", str(tmp_path)]) == 2
    assert "it is not a distft run directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, meant",
    [
        ("--lr", "optim.lr=VALUE"),
        ("--learning-rate=1e-4", "optim.lr=1e-4"),
        ("--warmup-steps=5", "optim.warmup_steps=5"),
        ("--lora-rank", "lora.rank=VALUE"),
        ("--num-train-epochs", "train.epochs=VALUE"),
        ("--lr-scheduler-type=cosine", "optim.scheduler=cosine"),  # TrainingArguments' names
        ("--save-total-limit=2", "output.keep_last=2"),
        ("--max-grad-norm", "optim.grad_clip=VALUE"),
        ("--bf16", "model.dtype=bfloat16"),
        ("--gradient-checkpointing", "model.activation_checkpointing=full"),
        ("--gradient-accumulation-steps=4", "train.global_batch_size=N (micro-batch x accumulation steps"),
        ("--frobnicate", None),
    ],
)
def test_a_flag_naming_a_setting_gets_its_key(flag, meant):
    assert flag_meant(flag) == meant or (meant and flag_meant(flag).startswith(meant))


def test_a_stray_flag_is_answered_and_every_help_points_at_the_settings(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", "--model", "micro", "--lr", "--num-epochs", "2"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert (
        "Did you mean optim.lr=VALUE, train.epochs=2? Settings are section.key=value (`distft config`)."
        in err
    )
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # every subcommand's own parser
    assert {p.epilog for p in (parser, *commands.values())} == {SEE_SETTINGS}
    assert "config" in commands


def test_the_experts_settings_help_names_what_auto_runs():
    """`distft config experts_implementation` says what auto picks, as the model code picks it."""
    (setting,) = [s for s in settings() if s.key == "model.experts_implementation"]
    assert f"auto: {experts_kernel('auto')} " in setting.doc
