"""A finished run is never replaced by accident: `distft train` with the same --out
refuses, naming the run, its last step and the choices; --overwrite replaces it; --resume
continues it from a checkpoint; an unfinished run with checkpoints resumes as before."""

from __future__ import annotations

import json

import pytest

from distft.cli import main
from distft.config import load_config, to_toml
from distft.errors import ConfigError
from distft.io.checkpoint import latest_checkpoint
from distft.io.preflight import check_finished_run, finished_step
from tests.helpers import metrics

RUN = [
    "--model", "micro",
    "--max-steps", "2",
    "train.global_batch_size=2",
    "train.micro_batch_size=2",
    "train.eval_batches=1",
    "data.max_length=384",
    "data.max_rows=8",
    "output.save_base=false",
]  # fmt: skip


def fake_run(path, steps: int = 5, checkpoint: int | None = None, exported: bool = True):
    """What `distft train` leaves: config.toml, metrics.jsonl, the adapter once finished."""
    path.mkdir(parents=True)
    (path / "config.toml").write_text(to_toml(load_config(None, ["model.name=micro"])))
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, steps + 1)))
    if exported:
        (path / "adapter").mkdir()
        (path / "adapter" / "adapter_config.json").write_text("{}")
    if checkpoint:
        (path / "checkpoints" / f"step-{checkpoint:06d}").mkdir(parents=True)
    return path


def config(out, *overrides: str):
    return load_config(None, ["model.name=micro", f"output.dir={out}", *overrides])


def test_finished_step_reads_the_last_metrics_line(tmp_path):
    assert finished_step(fake_run(tmp_path / "a", steps=7)) == 7
    assert finished_step(fake_run(tmp_path / "b", exported=False)) is None  # unfinished
    assert finished_step(tmp_path / "empty") is None


def test_a_finished_run_is_refused_with_the_choices(tmp_path):
    out = fake_run(tmp_path / "run", steps=5, checkpoint=4)
    with pytest.raises(ConfigError) as err:
        check_finished_run(config(out))
    message = str(err.value)
    assert f"{out} holds a finished run (step 5, its adapter exported)" in message
    assert "another --out" in message and "--overwrite to replace it" in message
    assert (
        f"distft train --resume {out} --max-steps N` to continue it from its checkpoint step-000004"
        in message
    )
    check_finished_run(config(out, "output.overwrite=true"))  # --overwrite
    check_finished_run(config(out), resuming=True)  # --resume: continues from step-000004


def test_resume_of_a_finished_run_without_checkpoints_is_refused(tmp_path):
    out = fake_run(tmp_path / "run", steps=3)
    with pytest.raises(ConfigError, match="kept no checkpoint to continue from"):
        check_finished_run(config(out), resuming=True)
    with pytest.raises(
        ConfigError, match="--resume continues a run from a checkpoint, and this one has none"
    ):
        check_finished_run(config(out))


def test_an_unfinished_run_with_checkpoints_still_resumes(tmp_path):
    check_finished_run(config(fake_run(tmp_path / "run", checkpoint=2, exported=False)))


def test_train_twice_refuses_then_overwrite_replaces(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *RUN, "--checkpoint-every", "1", "--out", str(out)]) == 0
    assert main(["train", *RUN, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{out} holds a finished run (step 2" in err
    assert main(["train", *RUN, "--max-steps", "3", "--overwrite", "--out", str(out)]) == 0
    assert [m["step"] for m in metrics(out)] == [1, 2, 3]  # a new run from step 1, not a resume
    assert latest_checkpoint(out) is None  # the old run's checkpoints went with it
    assert "resuming from" not in capsys.readouterr().out
