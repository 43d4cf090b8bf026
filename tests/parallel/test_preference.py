"""DPO and ORPO under the strategies whose loss head sees whole rows: each trains as one process
does on the same global batch of pairs (losses, gradient norms, rewards and the adapter), and the
others are refused before launch, in one line."""

from __future__ import annotations

import math
import random

import pytest

from distft.cli import main
from tests.helpers import assert_same_training, distft, metrics, write_jsonl

NAMES, DAYS = ["Anna", "Bob", "Chen", "Dana", "Eli", "Fay"], ["Monday", "Friday", "next week"]
PAIR_STATS = ("rewards_chosen", "rewards_rejected", "accuracy", "margin", "logps_chosen", "logps_rejected")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Who owns an action item, and a rejected answer that swaps the owner."""
    rows = []
    for i in range(32):
        owner, other = random.Random(i).sample(NAMES, 2)
        day = random.Random(100 + i).choice(DAYS)
        prompt = (
            f"Meeting {i}: {owner} drafts the budget by {day}; {other} reviews it. Who drafts it, and when?"
        )
        rows.append({"prompt": prompt, "chosen": f"{owner}, by {day}.", "rejected": f"{other}, by {day}."})
    return str(write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", rows))


def settings(data: str, objective: str) -> list[str]:
    return [
        "--model", "micro", "--data", data, f"train.objective={objective}", "train.max_steps=3",
        "train.global_batch_size=4", "train.micro_batch_size=1", "data.max_length=128",
        "optim.warmup_steps=1", "optim.lr=1e-3", "train.eval_every=0", "train.eval_batches=1",
    ]  # fmt: skip


def assert_same_pairs(run, reference, rtol: float = 1e-5) -> None:
    """The pair statistics of every step equal the reference's (rewards, margin, accuracy, log-probs)."""
    for got, want in zip(metrics(run), metrics(reference), strict=True):
        for name in PAIR_STATS:
            assert got[name] == pytest.approx(want[name], rel=rtol, abs=1e-6), (got["step"], name)


@pytest.mark.parametrize("objective, strategies", [("dpo", ["ddp", "fsdp"]), ("orpo", ["tp"])])
def test_trains_like_one_process(objective, strategies, pairs, tmp_path):
    reference = tmp_path / "single"
    assert main(["train", *settings(pairs, objective), "--out", str(reference)]) == 0
    first = metrics(reference)[0]
    if objective == "dpo":  # the policy starts as its reference: every margin 0, the loss log 2
        assert first["loss"] == pytest.approx(math.log(2), rel=1e-6)
        assert first["margin"] == first["rewards_chosen"] == 0.0 and first["accuracy"] == 0.0
    for strategy in strategies:
        run = tmp_path / strategy
        distft(
            "train", *settings(pairs, objective), "--strategy", strategy, "--nproc", "2", "--out", str(run)
        )
        assert_same_training(run, reference)
        assert_same_pairs(run, reference)
        # The bytes of both rows of every pair, counted as any run's are, match the formula.
        counted = [m for m in metrics(run) if "comm_bytes_expected" in m]
        assert counted and all(m["comm_bytes"] == m["comm_bytes_expected"] for m in counted), strategy


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--strategy", "tp-sp", "--nproc", "2"], "train.objective=dpo cannot run under --strategy tp-sp"),
        (["--strategy", "pp", "--nproc", "2"], "train.objective=dpo cannot run under --strategy pp"),
        (["--method", "full"], "--method full trains the base itself"),
        (["data.packing=true"], "set data.packing=false"),
    ],
    ids=["tp-sp", "pp", "full", "packing"],
)
def test_what_cannot_run_is_refused_before_launch(flags, says, pairs, tmp_path, capsys):
    assert main(["train", *settings(pairs, "dpo"), *flags, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()
