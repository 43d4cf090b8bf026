"""Data that data.max_length cuts for the most part is said before launch (`plan.truncation_warning`):
how much is cut, the length that keeps every token, and what the plan says that length costs."""

from __future__ import annotations

import json
import re

from distft.cli import main
from distft.config import load_config
from distft.data.chat import split_summary
from distft.plan import truncation_warning

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def test_most_rows_or_most_tokens_cut_is_said_with_the_length_and_its_plan():
    cfg = load_config(None, ["model.name=micro", "data.max_length=768"])
    # Every row cut to 768, a fifth of its tokens kept (within micro's 4,096 positions).
    whole = split_summary([768] * 4, [3_000, 2_800, 2_500, 2_000])
    said = truncation_warning(cfg, whole, 300.0)
    assert said.startswith("data.max_length=768 cuts 4 of 4 training rows, 77% of their tokens")
    assert (
        "the model never sees most of the data" in said and "data.max_length=3768 keeps every token" in said
    )
    longer, now = (float(n) * UNITS[unit] for n, unit in re.findall(r"([\d.]+) (.iB) per process", said))
    assert longer > now > 0, said  # the whole rows' activations, beside this length's
    # Most rows cut, by a little: said, without the claim about most of the data.
    little = truncation_warning(cfg, split_summary([768] * 3 + [500], [50, 40, 30, 0]), 300.0)
    assert "cuts 3 of 4 training rows, 4% of their tokens (data.truncation=middle). " in little
    # One row in four cut, though most of the tokens: said too.
    assert "cuts 1 of 4 training rows" in truncation_warning(
        cfg, split_summary([768] * 4, [9_000, 0, 0, 0]), None
    )
    # Most of the data trained as it is: nothing said.
    assert truncation_warning(cfg, split_summary([768, 600, 500, 400], [100, 0, 0, 0]), 300.0) is None
    assert truncation_warning(cfg, split_summary([], []), None) is None


def test_a_length_past_the_models_positions_names_the_scaling_that_reaches_it():
    cfg = load_config(None, ["model.name=qwen3-moe-micro", "data.max_length=2048"])  # 4,096 positions
    said = truncation_warning(cfg, split_summary([2048] * 2, [26_000, 20_000]), None)
    assert "data.max_length=28048 keeps every token; at that length: " in said
    assert "longer than the 4,096 positions" in said and "model.rope_scaling=yarn" in said


def test_train_says_it_before_launch_and_in_the_dry_run(tmp_path, capsys):
    rows = [{"transcript": f"speaker {i}: " + "we talked about the remote control. " * 120, "summary": "A remote."}
            for i in range(6)]  # fmt: skip
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [
        "train",
        "--model",
        "micro",
        "--data",
        str(data),
        "data.max_length=128",
        "--out",
        str(tmp_path / "run"),
    ]
    assert main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"\ntruncation: data\.max_length=128 cuts \d of \d training rows, 8\d% of their tokens", out
    ), out
    assert "GiB per process now." in out or "MiB per process now." in out
