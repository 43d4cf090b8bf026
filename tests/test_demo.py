"""`make demo`'s two stages at test scale: the shipped configs/demo-*.toml on the `micro` preset,
a few steps each. Stage 1 full-finetunes the random preset; stage 2 trains LoRA on stage 1's model
directory; eval scores the untrained preset, stage 1 and stage 2; every command says what the model
is. (The demo's figures, ROUGE-L and minutes, are in the README: too slow for the suite.)"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from distft.cli import main
from distft.infer import load_trained
from distft.io.lineage import read_lineage

ROOT = Path(__file__).parent.parent
SMALL = [
    "train.global_batch_size=2",
    "train.micro_batch_size=2",
    "train.eval_every=0",
    "train.eval_batches=1",
    "data.max_length=384",
    "data.max_rows=8",
]
PLAIN = "this is not a real language model"


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """(stage-1 run, stage-2 run, what stage 2's `distft train` printed)."""
    tmp = tmp_path_factory.mktemp("demo")
    base, lora = tmp / "demo-base", tmp / "demo"
    config = str(ROOT / "configs" / "demo-base.toml")
    assert (
        main(
            ["train", "--config", config, "--model", "micro", "--max-steps", "3", "--out", str(base), *SMALL]
        )
        == 0
    )
    config = str(ROOT / "configs" / "demo-lora.toml")
    stage2 = [
        "train",
        "--config",
        config,
        "--model",
        str(base / "model"),
        "--max-steps",
        "2",
        "--out",
        str(lora),
    ]
    return base, lora, stage2 + SMALL


@pytest.fixture(scope="module")
def stage2_output(stages):
    _, _, argv = stages
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(argv) == 0
    return buffer.getvalue()


def test_stage1_writes_a_full_model_that_knows_it_started_random(stages):
    base, _, _ = stages
    assert (base / "model" / "config.json").is_file() and (base / "model" / "tokenizer.json").is_file()
    lineage = read_lineage(base / "model")
    assert lineage == read_lineage(base)
    assert lineage["origin"]["preset"] == "micro" and lineage["origin"]["seed"] == 0
    assert [(s["method"], s["steps"], s["data"]) for s in lineage["stages"]] == [("full", 3, "sample")]


def test_stage2_trains_lora_on_the_stage1_weights(stages, stage2_output):
    base, lora, _ = stages
    assert (lora / "adapter" / "adapter_config.json").is_file() and not (lora / "model").exists()
    loaded = load_trained(run=str(lora))
    stage1 = AutoModelForCausalLM.from_pretrained(base / "model").eval()
    ids = torch.randint(0, 1000, (2, 16))
    with torch.no_grad(), loaded.model.disable_adapter():
        torch.testing.assert_close(
            loaded.model(input_ids=ids).logits, stage1(input_ids=ids).logits, rtol=0, atol=0
        )
    lineage = read_lineage(lora)
    assert [s["method"] for s in lineage["stages"]] == ["full", "lora"]
    assert lineage["stages"][0]["run"] == str(base.resolve()) and lineage["stages"][1]["run"] == str(
        lora.resolve()
    )


def test_stage2_header_says_what_the_model_is(stage2_output):
    text = " ".join(stage2_output.split())  # rich wraps long lines
    assert PLAIN in text and "`micro` preset" in text and "random initial weights" in text
    assert "3 steps of full finetuning" in text and "2 steps of LoRA (this run)" in text
    assert "the bundled synthetic meetings" in text
    assert "warning: optim.lr" not in text, "a random preset's descendant is not a pretrained checkpoint"


def test_eval_scores_untrained_stage1_and_stage2(stages, stage2_output, tmp_path, capsys):
    _, lora, _ = stages
    out = tmp_path / "scores.json"
    argv = ["eval", "--run", str(lora), "--rows", "8", "--max-new-tokens", "4", "--output", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr()
    scores = json.loads(out.read_text())
    assert list(scores["models"]) == ["untrained", "base", "finetuned"]
    assert len(scores["rows"]) == 8 and all("sample/validation.jsonl:" in r for r in scores["rows"])
    untrained, stage1 = scores["models"]["untrained"], scores["models"]["base"]
    assert untrained["loss"] != stage1["loss"], "the untrained row is the random preset, not stage 1"
    assert all(0 <= s["rougeL"] <= 1 for s in scores["models"].values())
    table = " ".join(printed.out.split())
    assert "random weights" in table and "steps of full finetuning" in table and "(this run)" in table
    assert PLAIN in " ".join(printed.err.split())


def test_eval_rows_are_never_trained_on():
    train = {json.loads(line)["id"] for line in (ROOT / "src/distft/data/sample/train.jsonl").open()}
    held_out = {json.loads(line)["id"] for line in (ROOT / "src/distft/data/sample/validation.jsonl").open()}
    assert len(held_out) >= 8 and not train & held_out


def test_infer_prints_the_notice_summary_and_reference(stages, stage2_output, capsys):
    _, lora, _ = stages
    assert main(["infer", "--run", str(lora), "--max-new-tokens", "4"]) == 0
    printed = capsys.readouterr()
    assert PLAIN in " ".join(printed.err.split())
    assert "--- generated summary ---" in printed.out
    reference = printed.out.split("--- reference summary (held out, never trained on) ---\n", 1)[1]
    assert re.match(r"The team met to ", reference), reference


def test_make_demo_runs_the_shipped_configs():
    recipe = (ROOT / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert "configs/demo-base.toml" in recipe and "configs/demo-lora.toml" in recipe
    assert "eval --run runs/demo" in recipe and "infer --run runs/demo" in recipe


def test_export_keeps_the_lineage_and_says_it_in_the_card(stages, stage2_output, tmp_path):
    _, lora, _ = stages
    assert main(["export", "--run", str(lora), "--out", str(tmp_path / "export"), "--dtype", "float32"]) == 0
    assert read_lineage(tmp_path / "export") == read_lineage(lora)
    card = " ".join((tmp_path / "export" / "README.md").read_text().split())
    assert "This is not a real language model" in card and "2 steps of LoRA" in card
