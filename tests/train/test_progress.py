"""What a run prints as it trains (`distft.train.progress`): a preference run reads as one, the
objective in its header and its reward margin and accuracy on every step line."""

import re

from safetensors.torch import load_file

from distft.cli import main
from tests.helpers import metrics

DPO = [
    "--model",
    "micro",
    "--data",
    "sample-pairs",
    "train.objective=dpo",
    "train.max_steps=2",
    "data.max_rows=16",
]


def test_a_preference_run_names_its_objective_and_prints_margin_and_accuracy(tmp_path, capsys):
    """... and counts pairs as pairs; the reference scored before step 1 (`dpo.precompute_reference`)
    draws a bar, over the pairs the run reads alone: its 2 steps' 8 and one validation batch's 4."""
    settings = [
        "data.max_length=256",
        "train.global_batch_size=4",
        "train.eval_batches=1",
        "train.log_every=1",
        "dpo.precompute_reference=true",
    ]
    assert main(["train", *DPO, *settings, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "finetune of micro toward the preferred answers, DPO (dpo.beta 0.1)" in out
    assert (
        "global batch 4 pairs = micro-batch 4 x accumulation 1 x data-parallel ranks 1; up to 2,048 " in out
    )
    assert re.search(r"split +┃ pairs ┃ .* ┃ truncated pairs ┃", out)
    assert re.search(r"│ train +│ 16 +│", out) and "2 steps of DPO (LoRA, this run)" in " ".join(out.split())
    assert re.search(r"^reference .* 12/12 pairs", out, re.MULTILINE)
    scores = load_file(tmp_path / "reference_logps.safetensors")
    assert scores["train"].isnan().any(dim=1).sum() == 16 - 8 and not scores["validation"][:4].isnan().any()
    records = metrics(tmp_path)
    for record in records:
        line = next(x for x in out.splitlines() if re.match(rf"step +{record['step']} ", x))
        assert f"margin {record['margin']:+.3f}  accuracy {record['accuracy']:.0%}" in line, line
    assert f"eval_accuracy {records[-1]['eval_accuracy']:.0%}" in line


def test_an_sft_runs_lines_hold_no_preference_figures(tmp_path, capsys):
    settings = ["train.max_steps=1", "data.max_rows=8", "data.max_length=256", "train.global_batch_size=4"]
    assert main(["train", "--model", "micro", *settings, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "lora finetune of micro (" in out and "margin" not in out and "accuracy" not in out
