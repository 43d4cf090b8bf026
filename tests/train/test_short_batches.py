"""A short batch (a validation split smaller than the ranks, or than one global batch) is filled
with blank items (`distft.data.pairs.blank_items`), so every rank runs whole micro-batches: the run
validates, exports its adapter and records the single process's validation loss, under data
parallelism (DDP, and FSDP, whose ranks must all run the same forwards) as for DPO's pairs."""

from __future__ import annotations

import pytest

from distft.cli import main
from tests.helpers import distft, metrics, write_jsonl
from tests.parallel.test_preference import pair_rows

RUN = [
    "--model", "micro",
    "train.max_steps=2",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
    "train.eval_batches=1",
    "data.max_length=256",
    "output.save_base=false",
]  # fmt: skip


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_a_validation_split_smaller_than_the_ranks_validates_and_exports(objective, tmp_path):
    if objective == "sft":  # 6 rows: 1 held out for validation
        rows = [
            {"transcript": f"A: item {i} is due on day {i}.\nB: noted.", "summary": f"Item {i}."}
            for i in range(6)
        ]
        data = [*RUN, "--data", str(write_jsonl(tmp_path / "rows.jsonl", rows))]
    else:  # 7 pairs: 1 held out
        data = [*RUN, "--objective", "dpo", "data.max_length=128"]
        data += ["--data", str(write_jsonl(tmp_path / "pairs.jsonl", pair_rows()[:7]))]
    single = tmp_path / "single"
    assert main(["train", *data, "--out", str(single)]) == 0
    want = metrics(single)[-1]["eval_loss"]
    for strategy in ("ddp", "fsdp"):
        run = tmp_path / strategy
        distft("train", *data, "--strategy", strategy, "--nproc", "2", "--out", str(run))
        assert (run / "adapter" / "adapter_model.safetensors").is_file()
        assert metrics(run)[-1]["eval_loss"] == pytest.approx(want, rel=1e-5), strategy
