"""`distft plan` asked with a training config (--config FILE, section.key=value, its flags on top)
plans what `distft train --dry-run` predicts for that config, to the byte: one path from a config
to what the planner models (`plan.auto.request_for`), the config's strategy in its own layout,
the data's labelled positions measured as the run measures them."""

from __future__ import annotations

import json

import pytest

import distft.plan
from distft.cli import main

FSDP = ["parallel.strategy=fsdp", "parallel.nproc=2"]
CASES = {  # the same words for both commands: --config, --model and section.key=value
    "the bundled 4B config": [
        "--config",
        "configs/qwen3-4b-lora.toml",
        "--model",
        "qwen3-4b",
        *FSDP,
        "data.source=sample",
    ],
    "DPO, an optimizer and FSDP dtypes": [
        *(
            "--model",
            "qwen3-4b",
            "train.objective=dpo",
            "model.activation_checkpointing=full",
            "optim.name=sgd",
        ),
        *(*FSDP, "model.dtype=bfloat16", "parallel.fsdp_reduce_dtype=float32", "data.source=sample-pairs"),
    ],
    "modules to save and added tokens, under tp": [
        *("--model", "micro", "lora.modules_to_save=['lm_head']", "model.added_tokens=['<speaker>']"),
        *("parallel.strategy=tp", "parallel.nproc=2"),
    ],
    "ring context parallelism under fsdp+cp": [
        *("--model", "micro", "parallel.strategy=fsdp+cp", "parallel.nproc=2", "parallel.cp_method=ring"),
    ],
}


def dry_run_prediction(argv: list[str], monkeypatch, capsys) -> dict:
    """The prediction `distft train ARGV --dry-run` prints, as it computed it."""
    said = {}
    monkeypatch.setattr(
        distft.plan, "dry_run", lambda cfg: said.setdefault("prediction", cfg.prediction) and 0
    )
    assert main(["train", *argv, "--dry-run"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    return said["prediction"]


@pytest.mark.parametrize("case", list(CASES))
def test_plan_of_a_config_is_its_dry_run_prediction_to_the_byte(case, monkeypatch, capsys):
    argv = CASES[case]
    prediction = dry_run_prediction(argv, monkeypatch, capsys)
    assert main(["plan", *argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    strategy = next(a.split("=")[1] for a in argv if a.startswith("parallel.strategy="))
    estimate = next(s for s in doc["strategies"] if s["strategy"] == strategy)
    assert prediction["layout"].startswith(estimate["label"]), case
    held = {k: int(v) for k, v in estimate["bytes_per_gpu"].items()}
    assert held.pop("total") == prediction["peak_mem_bytes"], case
    assert held == prediction["by_component"], case
    moved: dict[str, int] = {}
    for c in estimate["communication"]["collectives"]:
        moved[c["kind"]] = moved.get(c["kind"], 0) + int(c["logical_bytes"])
    assert moved == prediction["comm_bytes"] and moved, case
