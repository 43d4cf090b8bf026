"""Early stopping on the validation loss (`train.early_stopping_patience`, `distft.train.early_stopping`).

The runs are made to fail to improve on purpose: from step `ASCENT_FROM` on, a hook turns every
gradient around, so the optimizer climbs the loss and the validation loss rises at every validation
after the first (by ~0.7 per validation here, far above any summation-order noise). With
`train.eval_every=2` and patience 2 the best is step 2's and the run stops after step 6, the same
in one process and in a 2-stage pipeline, whose first stage computes no loss of its own.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil

import pytest

from distft.config import load_config
from distft.errors import ConfigError
from distft.infer.load import load_trained
from distft.io.checkpoint import read_loop_state
from distft.io.preflight import finished_step
from distft.tensors import local
from distft.train import TrainHooks, train
from distft.train.early_stopping import EarlyStopping, stop_line
from tests.helpers import ROOT, distft, metrics, write_jsonl

ASCENT_FROM = 3  # steps 1-2 descend (step 2's validation is the best), later ones climb
ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"What is {i} plus {i}?"},
            {"role": "assistant", "content": str(2 * i)},
        ]
    }
    for i in range(40)
]
RUN = [
    "train.max_steps=8",  # one validation short of running out: an early stop ends it at 6
    "train.global_batch_size=2",
    "train.micro_batch_size=1",  # two micro-batches: a pipeline has something to overlap
    "train.eval_every=2",
    "train.eval_batches=2",
    "train.early_stopping_patience=2",
    "data.max_length=64",
    "data.validation_fraction=0.2",
    "data.cache=false",
    "optim.warmup_steps=1",
    "optim.scheduler=constant",
    "output.save_base=false",
    "output.checkpoint_every=2",
]  # fmt: skip
STOP, BEST = 6, 2


def ascend(model, step: int) -> None:
    """From step `ASCENT_FROM` on, gradient ascent: every gradient negated (this rank's stage)."""
    if step >= ASCENT_FROM:
        for p in model.parameters():
            if p.grad is not None:
                local(p.grad).neg_()


def ascent_hooks() -> TrainHooks:
    """For `DISTFT_HOOKS=tests.train.test_early_stopping:ascent_hooks` in every rank of a CLI run."""
    return TrainHooks(after_backward=ascend)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "rows.jsonl", ROWS)


def run_in_process(out, rows, *overrides: str):
    """`train` in this process with `RUN` and `overrides`; (result, what it printed)."""
    cfg = load_config(
        None, ["model.name=micro", *RUN, f"data.source={rows}", f"output.dir={out}", *overrides]
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = train(cfg, ascent_hooks())
    return result, printed.getvalue()


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, rows):
    out = tmp_path_factory.mktemp("stopped") / "run"
    result, printed = run_in_process(out, rows)
    return out, result, printed


# ---- the decision ---------------------------------------------------------------------------


def test_patience_counts_validations_without_improvement():
    es = EarlyStopping(patience=2, delta=0.1)
    assert not es.update(3.0, 10)  # the first is always the best so far
    assert not es.update(2.95, 20)  # fell, but by no more than delta: no improvement (1)
    assert not es.update(2.5, 30)  # an improvement: the count starts over
    assert (es.best, es.best_step, es.stale) == (2.5, 30, 0)
    assert not es.update(2.5, 40)  # equal is no improvement (1)
    assert es.update(float("nan"), 50)  # nor is NaN (2): stop
    assert (es.best, es.best_step, es.stale) == (2.5, 30, 2)


def test_patience_zero_never_stops_but_keeps_the_best():
    es = EarlyStopping()
    assert not any(es.update(loss, step) for step, loss in enumerate([5.0, 6.0, 7.0, 8.0, 4.0], 1))
    assert (es.best, es.best_step, es.stale) == (4.0, 5, 0)


def test_the_state_round_trips_bit_for_bit_through_json():
    es = EarlyStopping(patience=3)
    fresh = EarlyStopping(patience=3)
    fresh.load_state_dict(json.loads(json.dumps(es.state_dict())))  # nothing yet: inf survives
    assert fresh == es and math.isinf(fresh.best)
    es.update(0.1 + 0.2, 7)  # 0.30000000000000004: every bit must come back
    es.update(1.0, 9)
    fresh.load_state_dict(json.loads(json.dumps(es.state_dict())))
    assert fresh == es and fresh.best == 0.1 + 0.2
    fresh.load_state_dict(None)  # a checkpoint written before early stopping: a fresh state
    assert fresh == EarlyStopping(patience=3)


def test_a_checkpoint_without_loop_state_reads_as_none(tmp_path):
    (tmp_path / "trainer.json").write_text(json.dumps({"step": 4, "scheduler": {}, "world_size": 1}))
    assert read_loop_state(tmp_path) == {}
    loop = {"early_stopping": {"best": 1.5, "best_step": 2, "stale": 1}}
    (tmp_path / "trainer.json").write_text(json.dumps({"step": 4, "scheduler": {}, "loop": loop}))
    assert read_loop_state(tmp_path) == loop


def test_the_line():
    record = EarlyStopping(patience=2, delta=0.01, best=1.2, best_step=20, stale=2).record(40, 1.234)
    assert stop_line(record) == (
        "early stop at step 40: validation loss 1.2340 has not improved by more than 0.01 on 1.2000 "
        "(step 20) for 2 validations (train.early_stopping_patience=2); keeping the last step's weights"
    )


@pytest.mark.parametrize(
    ("validation", "why"),
    [("train.eval_batches=0", "validates never"), ("train.eval_every=0", "validates only at the end")],
)
def test_refused_without_validations_to_count(validation, why):
    with pytest.raises(
        ConfigError, match=f"train.early_stopping_patience=2 counts validations, and this run {why}"
    ):
        load_config(None, ["train.early_stopping_patience=2", validation])
    load_config(None, ["train.early_stopping_patience=0", validation])  # off: nothing to refuse


# ---- runs -----------------------------------------------------------------------------------


def test_a_run_stops_after_patience_validations_and_finishes(stopped):
    out, result, printed = stopped
    assert [m["step"] for m in metrics(out)] == list(range(1, STOP + 1))
    assert list(result.eval_losses) == [2, 4, 6] and result.stopped_by is None
    losses = result.eval_losses
    assert losses[2] < losses[4] < losses[6]  # the ascent did climb
    record = metrics(out)[-1]["early_stop"]
    assert (
        record
        == result.early_stop
        == {
            "step": STOP,
            "eval_loss": losses[STOP],
            "best_eval_loss": losses[BEST],
            "best_step": BEST,
            "validations_without_improvement": 2,
            "patience": 2,
            "delta": 0.0,
            "kept": "last",
        }
    )
    assert not any("early_stop" in m for m in metrics(out)[:-1])
    assert printed.count("early stop at step") == 1
    line = f"early stop at step {STOP}: validation loss {losses[STOP]:.4f} has not improved on "
    assert f"{line}{losses[BEST]:.4f} (step {BEST}) for 2 validations" in printed
    # Finished as an ordinary end: the adapter of the last step, which `distft infer` loads.
    assert finished_step(out) == STOP
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and (out / "ranks.json").is_file()
    load_trained(str(out))
    # Each checkpoint holds the state as it was after its step's validation.
    state = read_loop_state(out / "checkpoints" / "step-000004")["early_stopping"]
    assert state == {"best": losses[BEST], "best_step": BEST, "stale": 1}


def test_patience_zero_runs_to_max_steps(tmp_path, rows, stopped):
    result, printed = run_in_process(tmp_path / "run", rows, "train.early_stopping_patience=0")
    assert [m["step"] for m in metrics(tmp_path / "run")] == list(range(1, 9))
    assert result.early_stop is None and "early stop" not in printed
    assert not any("early_stop" in m for m in metrics(tmp_path / "run"))
    assert {s: result.eval_losses[s] for s in (2, 4, 6)} == stopped[1].eval_losses  # the same run so far


def test_a_resumed_run_stops_where_the_uninterrupted_one_did(tmp_path, rows, stopped):
    """Resumed from step 4's checkpoint (one validation without improvement behind it), the run
    stops after step 6 as the uninterrupted one did; a fresh state would take step 6's validation
    for the best and run on to step 8."""
    out = tmp_path / "run"
    shutil.copytree(stopped[0], out)
    shutil.rmtree(out / "adapter")
    shutil.rmtree(out / "checkpoints" / f"step-{STOP:06d}")  # the last step's: gone with the crash
    result, printed = run_in_process(out, rows)
    assert "(step 4)" in printed and [m["step"] for m in metrics(out)] == list(range(1, STOP + 1))
    assert result.early_stop == stopped[1].early_stop  # bit for bit: the losses and the restored best


def test_a_pipeline_stops_after_the_same_step(tmp_path, rows, stopped):
    """Two pipeline stages (gloo): only the last computes the validation loss; both stop after
    step 6, with the single process's losses (to summation order), and export."""
    out = tmp_path / "pp"
    env = {"DISTFT_HOOKS": "tests.train.test_early_stopping:ascent_hooks", "PYTHONPATH": str(ROOT)}
    args = ["--model", "micro", *RUN, f"data.source={rows}", "--strategy", "pp", "--nproc", "2"]
    proc = distft("train", *args, "--out", str(out), env=env)
    assert proc.stdout.count("early stop at step 6: ") == 1, proc.stdout[-3000:]
    assert [m["step"] for m in metrics(out)] == list(range(1, STOP + 1))
    got, want = metrics(out)[-1]["early_stop"], stopped[1].early_stop
    assert got["best_step"] == want["best_step"] and got["validations_without_improvement"] == 2
    for key in ("eval_loss", "best_eval_loss"):
        assert got[key] == pytest.approx(want[key], rel=1e-5)
    assert finished_step(out) == STOP and (out / "adapter" / "adapter_model.safetensors").is_file()
