"""The single-process loop end to end: loss falls, outputs are standard, the adapter round-trips."""

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from distft.cli import main
from distft.config import load_config
from distft.train import train
from distft.train.setup import lr_lambda

QUICK = [
    "model.name=micro",
    "train.max_steps=12",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.eval_every=6",
    "train.eval_batches=1",
    "data.max_length=384",
    "data.max_rows=64",
    "optim.lr=1e-2",
    "optim.warmup_steps=2",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = load_config(None, [*QUICK, f"output.dir={out}"])
    return out, train(cfg)


def test_loss_falls_and_metrics_are_logged(run):
    out, _result = run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s", "peak_mem_bytes"):
        assert all(key in r for r in records), key
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-3:]) / 3
    assert last < first - 0.5, (first, last)
    assert "eval_loss" in records[5] and "eval_loss" in records[11]
    assert records[11]["eval_loss"] < records[5]["eval_loss"] or records[11]["eval_loss"] < first


def test_outputs_are_standard(run):
    out, _ = run
    assert (out / "config.toml").is_file()
    assert load_config(out / "config.toml").model.name == "micro"
    assert {p.name for p in (out / "adapter").iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
        "manifest.json",  # every file's size and SHA-256 (`distft.io.files`)
    }
    assert (out / "base" / "config.json").is_file() and (out / "base" / "tokenizer.json").is_file()
    assert not list(out.glob(".*tmp*")), "no temporary directories left behind"


def test_adapter_round_trip_gives_identical_logits(run):
    out, result = run
    base = AutoModelForCausalLM.from_pretrained(out / "base")
    loaded = PeftModel.from_pretrained(base, out / "adapter").eval()
    trained = result.model.lm.eval()
    ids = torch.randint(0, 1000, (2, 24))
    with torch.no_grad():
        expected = trained(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
        with loaded.disable_adapter():
            base_logits = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert not torch.allclose(base_logits, expected), "the adapter changes the model"


def test_infer_prints_a_summary(run, capsys):
    out, _ = run
    assert main(["infer", "--run", str(out), "--max-new-tokens", "16"]) == 0
    printed = capsys.readouterr().out
    assert "--- held-out meeting" in printed
    summary = printed.split("--- generated summary ---\n", 1)[1].strip()
    assert summary, "generation produced no text"


def test_eval_compares_base_and_finetuned(run, capsys):
    out, _ = run
    assert main(["eval", "--run", str(out), "--rows", "2", "--max-new-tokens", "8"]) == 0
    printed = capsys.readouterr().out
    assert "base" in printed and "finetuned" in printed and "ROUGE-L" in printed


def test_schedule_warms_up_then_decays():
    cfg = load_config(None, ["train.max_steps=100", "optim.warmup_steps=10", "optim.min_lr_ratio=0.1"])
    f = lr_lambda(cfg)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(99) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 99))


def test_bad_input_exits_2_without_traceback(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"transcript": "A: hi", "summary": "Hi."}\n{"transcript": 3\n')
    assert main(["train", "--data", str(bad), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2" in err and "Traceback" not in err
