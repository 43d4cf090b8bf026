"""Reliability: exact resume for each kind of strategy, a killed rank, a hung collective, a
diverged step, a failed checkpoint write, and bad input refused before anything is launched.

Faults are injected with the DISTFT_FAULT_* variables of `tests.faults` (through distft's
`DISTFT_HOOKS`, which `tests.helpers` sets for a run that names one). Launches are grouped: one
launch trains every one-dimensional strategy in turn and one resumes them all (`tests.batched`),
and only the killed rank and the hung collective need torchrun for real.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from distft.cli import main
from distft.config import load_config, to_toml
from distft.io.checkpoint import latest_checkpoint, read_loop_state
from distft.layout import SPECS
from tests import faults
from tests.batched import trained
from tests.helpers import adapter, assert_same_training, crashed_copy, distft, metrics, run_cli

WORLD = 2
# Every strategy on one mesh dimension, at 2 ranks; those on several resume across layouts in
# tests/parallel/test_families.py.
STRATEGIES = [name for name, spec in SPECS.items() if len(spec.dims) == 1]
# 2 steps, a checkpoint after each: a resume from step 1's must restore the weights, Adam's moments,
# the schedule's position (step 2 trains at the decayed rate), the data's and every rank's RNG to
# train step 2 bitwise. Dropout on, so a resume that failed to restore any rank's RNG would draw
# other dropout masks and show in the losses.
RUN = [
    "model.name=micro",
    "train.max_steps=2",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
    "train.eval_every=0",
    "train.eval_batches=0",  # compared by losses and adapters
    "data.max_length=192",  # near the least each row's answer and prompt need: a step costs its tokens
    "data.max_rows=32",
    "optim.warmup_steps=1",
    "optim.lr=1e-3",
    "lora.dropout=0.1",
    "output.checkpoint_every=1",
    "output.save_base=false",  # the adapters are compared as tensors, never loaded onto a base
]
# Resumed at another world size the dropout masks differ by construction (each rank draws its
# own): these runs turn dropout off and compare to 1e-5, as the parity tests do.
NO_DROPOUT = ["lora.dropout=0.0"]


def crash_after_step_1(full: Path, crashed: Path) -> None:
    """What a crash during step 2 leaves: the run dir with everything after step 1 gone (the last
    step's checkpoint too)."""
    crashed_copy(full, crashed, 1)


# ---- resume is exact, for every strategy (one pair of processes, in-process `train`) -----------


RUNS = {s: (s, RUN) for s in STRATEGIES} | {
    f"{s}-no-dropout": (s, [*RUN, *NO_DROPOUT]) for s in ("ddp", "tp-sp")
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Each run uninterrupted (one launch), then each strategy's crashed copy resumed (another)."""
    root = tmp_path_factory.mktemp("strategies")
    full = {
        name: ["--strategy", strategy, "--nproc", str(WORLD), *overrides, "--out", str(root / name / "full")]
        for name, (strategy, overrides) in RUNS.items()
    }
    trained(full, WORLD, root / "logs-full")
    for strategy in STRATEGIES:
        crash_after_step_1(root / strategy / "full", root / strategy / "crashed")
    resumed = {s: ["--resume", str(root / s / "crashed")] for s in STRATEGIES}
    trained(resumed, WORLD, root / "logs-resumed")
    return root


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_is_exact(runs, strategy):
    """Per-step losses, gradient norms and the final adapter equal the uninterrupted run's, bitwise."""
    full, resumed = runs / strategy / "full", runs / strategy / "crashed"
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
    got, want = metrics(resumed), metrics(full)
    assert [m["step"] for m in got] == [1, 2]
    assert [(m["loss"], m["grad_norm"]) for m in got] == [(m["loss"], m["grad_norm"]) for m in want]
    a, b = adapter(resumed), adapter(full)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.parametrize("strategy", ["ddp", "tp-sp"])
def test_checkpoint_resumes_in_one_process(runs, strategy, tmp_path):
    """DCP reshards: a 2-rank DDP checkpoint, and a tp-sp one (shards saved as DTensors under the
    unsplit names), resume as `--strategy single` and train on like the 2-rank run (fp32, 1e-5)."""
    full, crashed = runs / f"{strategy}-no-dropout" / "full", tmp_path / "crashed"
    crash_after_step_1(full, crashed)
    assert main(["train", "--resume", str(crashed), "--strategy", "single", "--nproc", "1"]) == 0
    assert_same_training(crashed, full)


# ---- a killed rank: torchrun restarts every rank, which resume from the last checkpoint -------


def test_killed_rank_restarts_and_finishes_like_an_uninterrupted_run(runs, tmp_path):
    out = tmp_path / "killed"
    proc = distft(
        "train", "--strategy", "ddp", "--nproc", "2", "--max-restarts", "1", *RUN, "--out", str(out),
        env={"DISTFT_FAULT_KILL_AT_STEP": "2"},  # rank 1 SIGKILLs itself as step 2 begins
    )  # fmt: skip
    # The agent saw the kill (or first its peer, which lost its connection in the next collective),
    # then restarted both ranks.
    assert "exitcode: -9" in proc.stderr or "lost its connection to another rank" in proc.stderr
    assert "resuming from" in proc.stdout and "(step 1)" in proc.stdout
    got, want = metrics(out), metrics(runs / "ddp" / "full")
    assert [(m["step"], m["loss"], m["grad_norm"]) for m in got] == [
        (m["step"], m["loss"], m["grad_norm"]) for m in want
    ]
    a, b = adapter(out), adapter(runs / "ddp" / "full")
    assert all(torch.equal(a[k], b[k]) for k in b)


# ---- a hung rank: the collective fails within parallel.timeout_s, naming rank and operation ---


def test_hung_rank_fails_within_the_timeout_naming_rank_and_operation(tmp_path):
    proc = run_cli(
        "train", "--strategy", "ddp", "--nproc", "2", *RUN, "output.checkpoint_every=0",
        "parallel.timeout_s=3", "--out", str(tmp_path / "hung"),
        env={"DISTFT_FAULT_HANG_AT_STEP": "2", "DISTFT_FAULT_HANG_S": "300"}, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (
        "Rank 0 of 2 waited more than parallel.timeout_s=3 s in the all-reduce of arrival times and "
        "stop signals before step 2" in proc.stderr
    ), proc.stderr[-3000:]
    assert "distft: the run failed. Rank 0 ended first (exit code 1)" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---- a diverged step: stop before the update (or skip it); the checkpoint stays good ----------

SINGLE = [*RUN, "train.micro_batch_size=2", "train.max_steps=4", "output.checkpoint_every=2"]


def test_nonfinite_step_stops_then_resumes_and_skips(tmp_path, monkeypatch, capsys):
    out = tmp_path / "nan"
    monkeypatch.setenv("DISTFT_HOOKS", faults.HOOKS)  # in this process: tests.helpers does not set it
    monkeypatch.setenv("DISTFT_FAULT_NAN_AT_STEP", "3")  # every gradient NaN after step 3's backward
    assert main(["train", *SINGLE, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "Step 3: the loss is" in err and "gradient norm nan" in err and "step-000002, is intact" in err
    assert "Traceback" not in err
    assert [m["step"] for m in metrics(out)] == [1, 2]
    assert latest_checkpoint(out).name == "step-000002" and not (out / "adapter").exists()

    # The checkpoint loads; with train.on_nonfinite=skip (a change a resume accepts) step 3 is
    # skipped, weights untouched, and the run finishes.
    assert main(["train", "--resume", str(out), "train.on_nonfinite=skip"]) == 0
    assert "resuming from" in capsys.readouterr().out
    records = metrics(out)
    assert [m["step"] for m in records] == [1, 2, 3, 4]
    assert records[2]["skipped"] and math.isnan(records[2]["grad_norm"])
    assert "skipped" not in records[3] and math.isfinite(records[3]["loss"])
    assert all(torch.isfinite(t).all() for t in adapter(out).values())


# ---- a failed checkpoint write leaves the previous checkpoint loadable ------------------------


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["shards", "shards-in-dcp", "manifest", "export"])
def test_a_disk_that_fills_during_any_write_keeps_the_previous_state(where, tmp_path, monkeypatch, capsys):
    """A full disk while a checkpoint's shards, DCP's own wrapper of a rank's failure (a
    BaseException, not an Exception), its manifest, or the final adapter is written: one line, exit
    1, nothing half-written in place, and the last checkpoint resumes the run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import distft.io.checkpoint as checkpoints
    import distft.io.save as save

    out = tmp_path / "disk-full"
    real_save, real_manifest, calls = dcp.save, checkpoints.write_manifest, []

    def save_then_fill_the_disk(state, checkpoint_id, **kwargs):
        calls.append(checkpoint_id)
        if len(calls) == 1:
            return real_save(state, checkpoint_id=checkpoint_id, **kwargs)
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half a shard")
        if where == "shards-in-dcp":
            raise CheckpointException("save", {0: (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), None)})
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def manifest_then_fill_the_disk(folder):
        calls.append(folder)
        return real_manifest(folder) if len(calls) == 1 else _disk_full()

    if where.startswith("shards"):
        monkeypatch.setattr(dcp, "save", save_then_fill_the_disk)
    elif where == "manifest":
        monkeypatch.setattr(checkpoints, "write_manifest", manifest_then_fill_the_disk)
    else:
        monkeypatch.setattr(save, "save_file", _disk_full)  # the adapter's weights
    run = [*SINGLE, "output.checkpoint_every=1", "train.max_steps=3"]
    assert main(["train", *run, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "No space left on device" in err
    if where == "export":  # every step checkpointed, the last included: a resume only exports
        assert not (out / "adapter").exists() and (out / "checkpoints" / "step-000003").is_dir()
        monkeypatch.undo()
        assert main(["train", "--resume", str(out)]) == 0 and (out / "adapter").is_dir()
        return
    assert "Writing the checkpoint of step 2 failed on rank 0" in err and "step-000001, is intact" in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]  # no temporary
    if where != "shards":
        return
    monkeypatch.undo()
    assert main(["train", "--resume", str(out)]) == 0
    assert "step-000001 (step 1)" in capsys.readouterr().out  # "resuming from .../step-000001 (step 1)"
    assert [m["step"] for m in metrics(out)] == [1, 2, 3]


# ---- a failure after the last step: the trained weights stay in its checkpoint ---------------

# Validation after step 2 only (the last step of the failed run, and of the run extended to 3).
AFTER = [
    *SINGLE,
    "train.max_steps=2",
    "train.eval_every=2",
    "train.eval_batches=2",
    "output.checkpoint_every=0",
]


def test_a_failure_after_the_last_step_keeps_its_checkpoint_and_the_resume_finishes_the_run(
    tmp_path, monkeypatch, capsys
):
    """An error in the final validation, with no checkpoints asked for: one line that says the
    trained weights are safe and how to finish, and the last step's checkpoint, marked with its
    record until its validation has run. `--resume` runs only that validation and the export (one
    record of step 2); its early-stopping state then equals an uninterrupted run's, so the run
    extended to step 3 equals the uninterrupted 3-step run bitwise (which implies that its step-2
    adapter did too)."""
    out, full = tmp_path / "failed", tmp_path / "full"
    monkeypatch.setenv("DISTFT_HOOKS", faults.HOOKS)  # in this process: tests.helpers does not set it
    monkeypatch.setenv("DISTFT_FAULT_RANK", "0")
    monkeypatch.setenv("DISTFT_FAULT_RAISE_IN", "validation")
    assert main(["train", *AFTER, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    checkpoint = out / "checkpoints" / "step-000002"
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert (
        f"KeyError: 'a planted fault'. The trained weights are safe in {checkpoint}: "
        f"`distft train --resume {out}` finishes the run." in err
    )
    assert [m["step"] for m in metrics(out)] == [1] and not (out / "adapter").exists()
    pending = read_loop_state(checkpoint)["pending"]
    assert pending["step"] == 2 and "eval_loss" not in pending

    monkeypatch.delenv("DISTFT_FAULT_RAISE_IN")
    assert main(["train", "--resume", str(out), "--checkpoint-every", "1"]) == 0  # kept from here on
    assert [(m["step"], "eval_loss" in m) for m in metrics(out)] == [(1, False), (2, True)]
    assert metrics(out)[1]["loss"] == pending["loss"] and (out / "adapter").is_dir()
    assert main(["train", "--resume", str(out), "--max-steps", "3"]) == 0
    assert main(["train", *AFTER, "train.max_steps=3", "--checkpoint-every", "1", "--out", str(full)]) == 0
    for step in (2, 3):  # early stopping's state as the uninterrupted run left it: no pending step
        got, want = (read_loop_state(run / "checkpoints" / f"step-{step:06d}") for run in (out, full))
        assert got == want and "pending" not in got
    figures = ("step", "loss", "grad_norm", "eval_loss")
    assert [[m.get(k) for k in figures] for m in metrics(out)] == [
        [m.get(k) for k in figures] for m in metrics(full)
    ]
    a, b = adapter(out), adapter(full)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


# ---- bad input: one paragraph, exit code 2, no traceback, nothing launched --------------------


def _file(tmp: Path, name: str, text: str | bytes) -> str:
    path = tmp / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return str(path)


def _row(**fields) -> str:
    return json.dumps(fields) + "\n"


MEETING = _row(transcript="A: " + "we should ship the remote control on time " * 8, summary="They plan.")


def _foreign_run(tmp: Path) -> str:
    """A run dir whose config (optim.lr) differs from the command's, with a checkpoint in it."""
    run = tmp / "foreign"
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / "config.toml").write_text(to_toml(load_config(None, ["model.name=micro", "optim.lr=5e-3"])))
    return str(run)


def _finished_run(tmp: Path) -> str:
    """A run dir that finished (its adapter exported) after 5 steps, without checkpoints."""
    run = tmp / "finished"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text("{}")
    (run / "config.toml").write_text(to_toml(load_config(None, ["model.name=micro"])))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)))
    return str(run)


PP = ["--strategy", "pp", "--nproc", "2"]


def _timeline(tmp: Path, cut: list[int], busy: bool = True) -> str:
    """A pipeline run's directory holding only its timeline: `cut` layers per stage, 0.1 s a layer
    (busy=False: a timeline from before each stage's busy time was recorded)."""
    run = tmp / "measured"
    run.mkdir(exist_ok=True)
    timeline = {"schedule": "1f1b", "ranks": [], "layers_per_stage": cut}
    if busy:
        timeline["stage_busy_s"] = [0.1 * n for n in cut]
    (run / "pipeline_timeline.json").write_text(json.dumps(timeline), encoding="utf-8")
    return str(run)


def _no_network(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)

    def unreachable(*args, **kwargs):
        raise OSError(errno.ENETUNREACH, "Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", unreachable)


# (id, extra argv (a callable of tmp_path for files), monkeypatch set-up, key phrase of the message)
BAD_INPUTS = [
    ("unknown strategy", ["--strategy", "zero9"], None, "`parallel.strategy` is 'zero9'; choose one of"),
    ("nproc below 1", ["--nproc", "0"], None, "`parallel.nproc` must be positive, got 0"),
    (
        "nproc above the GPUs",
        ["--strategy", "ddp", "--nproc", "2", "train.device=cuda"],
        lambda mp_: mp_.setattr("distft.train.preflight._cuda_count", lambda: 1),
        "--nproc 2 asks for more processes than the 1 GPU on this node",
    ),
    (
        "cuda without a GPU",
        ["train.device=cuda"],
        lambda mp_: mp_.setattr("distft.train.preflight._cuda_count", lambda: 0),
        "train.device=cuda, but this machine has no CUDA device",
    ),
    (
        "TP degree vs heads",
        ["--strategy", "tp", "--nproc", "3"],
        None,
        "4 query heads and 2 KV heads; the TP degree must divide both (e.g. --nproc 2)",
    ),
    (
        "micro-batches vs batch",
        ["train.global_batch_size=6", "train.micro_batch_size=4"],
        None,
        "train.global_batch_size (6) must be a multiple of train.micro_batch_size",
    ),
    ("LoRA rank 0", ["lora.rank=0"], None, "`lora.rank` must be positive, got 0"),
    ("empty dataset", lambda t: ["--data", _file(t, "empty.jsonl", "")], None, "has 0 row(s)"),
    (
        "row without summary",
        lambda t: ["--data", _file(t, "rows.jsonl", MEETING + _row(transcript="A: hi"))],
        None,
        "rows.jsonl:2: missing field `summary`",
    ),
    (
        "malformed JSON row",
        lambda t: ["--data", _file(t, "bad.jsonl", MEETING + '{"transcript": \n')],
        None,
        "bad.jsonl:2: not valid JSON",
    ),
    ("missing data file", lambda t: ["--data", str(t / "nope.jsonl")], None, "nope.jsonl does not exist"),
    (
        "no room for the summary",
        ["data.max_length=64"],
        None,
        "leave 0 of data.max_length=64 tokens for its longest prompt text",
    ),
    (
        "unknown model, HF_HUB_OFFLINE",
        ["--model", "nobody/no-such-model"],
        lambda mp_: mp_.setenv("HF_HUB_OFFLINE", "1"),
        "the Hugging Face hub cannot be reached (offline",
    ),
    (
        "unknown model, no network",
        ["--model", "nobody/no-such-model"],
        _no_network,
        "point --model at DIR, the directory holding its config.json",
    ),
    (
        "different config in --out",
        lambda t: ["--out", _foreign_run(t), "optim.lr=1e-3"],
        None,
        "holds a run with a different config, and its checkpoint step-000002 would resume into it (optim.lr: 0.005 -> 0.001",
    ),
    ("--resume a non-run dir", lambda t: ["--resume", str(t)], None, "not a distft run directory"),
    (
        "malformed TOML",
        lambda t: ["--config", _file(t, "bad.toml", "[optim]\nlr = \n")],
        None,
        "(at line 2, column 6)",
    ),
    (
        "unknown config key",
        ["optim.warmup_step=5"],
        None,
        "Unknown config key `optim.warmup_step`. Did you mean `optim.warmup_steps`?",
    ),
    ("missing config file", lambda t: ["--config", str(t / "nope.toml")], None, "nope.toml does not exist"),
    (
        "unwritable output dir",
        lambda t: ["--out", str(Path(_file(t, "a-file", "")) / "run")],
        None,
        "/a-file/run is not writable (",
    ),
    (
        "disk too small",
        [],
        lambda mp_: mp_.setattr(
            shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12 - 5000, 5000)
        ),
        "has 5000 bytes free, but the run needs about",
    ),
    (
        "unknown on_nonfinite",
        ["train.on_nonfinite=ignore"],
        None,
        "`train.on_nonfinite` is 'ignore'; choose one of stop, skip",
    ),
    (
        "negative max-restarts",
        ["--strategy", "ddp", "--nproc", "2", "--max-restarts", "-1"],
        None,
        "`parallel.max_restarts` cannot be negative",
    ),
    ("max-restarts in one process", ["--max-restarts", "2"], None, "which --strategy single does not use"),
    (
        "unknown pipeline schedule",
        ["--strategy", "pp", "--nproc", "2", "parallel.schedule=zigzag"],
        None,
        "`parallel.schedule` is 'zigzag'; choose one of gpipe, 1f1b",
    ),
    (
        "a value no strategy takes, where it is ignored",
        ["--strategy", "ddp", "--nproc", "2", "parallel.fsdp_param_dtype=int8"],
        None,
        "`parallel.fsdp_param_dtype` is 'int8'; choose one of float32, bfloat16",
    ),
    (
        "more pipeline stages than layers",
        [
            "--strategy",
            "pp",
            "--nproc",
            "2",
            "parallel.schedule=interleaved-1f1b",
            "parallel.stages_per_rank=3",
        ],
        None,
        "needs 6 stages of at least one decoder layer, but micro has 4",
    ),
    (
        "finished run in --out",
        lambda t: ["--out", _finished_run(t)],
        None,
        "holds a finished run (step 5, its adapter exported); this command would replace it",
    ),
    (
        "--resume a finished run without checkpoints",
        lambda t: ["--resume", _finished_run(t)],
        None,
        "that run finished at step 5 and kept no checkpoint to continue from",
    ),
    (
        "QLoRA with tensor parallelism",
        ["--strategy", "tp", "--nproc", "2", "--method", "qlora"],
        None,
        "--method qlora cannot run with --strategy tp",
    ),
    # Files that are not what their name says: what they look like, named before anything runs.
    (
        "UTF-16 data file",
        lambda t: ["--data", _file(t, "utf16.jsonl", (MEETING * 2).encode("utf-16"))],
        None,
        "utf16.jsonl is not UTF-8 text: it looks like UTF-16 text (a little-endian byte-order mark); re-save it as UTF-8",
    ),
    (
        "binary data file",
        lambda t: ["--data", _file(t, "data.jsonl", bytes(range(256)))],
        None,
        "data.jsonl is not UTF-8 text: it looks like binary data (a NUL byte at offset 0)",
    ),
    (
        "a byte that is not UTF-8",
        lambda t: ["--data", _file(t, "latin.jsonl", MEETING.encode() + b'{"transcript": "A: caf\xe9"}\n')],
        None,
        "latin.jsonl:2: not UTF-8 text (byte 0xE9 at column 23",
    ),
    (
        "JSON lines named .parquet",
        lambda t: ["--data", _file(t, "rows.parquet", MEETING * 2)],
        None,
        "rows.parquet is not a Parquet file: it starts like JSON lines; rename it rows.jsonl",
    ),
    (
        "Parquet named .jsonl",
        lambda t: ["--data", _file(t, "rows.jsonl", b"PAR1" + bytes(100) + b"PAR1")],
        None,
        "rows.jsonl is a Parquet file, not JSON lines: rename it rows.parquet",
    ),
    (
        "a JSON array in .json",
        lambda t: ["--data", _file(t, "rows.json", "[" + MEETING + "," + MEETING + "]")],
        None,
        "rows.json holds a JSON array; distft reads JSON lines",
    ),
    (
        "TSV data file",
        lambda t: ["--data", _file(t, "rows.tsv", "transcript\tsummary\n")],
        None,
        "a local dataset must be a .jsonl file (.json: also JSON lines), a .parquet or a .csv file (tab-separated",
    ),
    (
        "binary config file",
        lambda t: ["--config", _file(t, "run.toml", b"\x1f\x8b" + bytes(20))],
        None,
        "run.toml is not UTF-8 text: it looks like a gzip archive; decompress it first",
    ),
    # Numbers that pass the type check but make no sense: each setting's range (`config.RANGES`).
    ("NaN learning rate", ["optim.lr=nan"], None, "`optim.lr` must be a finite number, got nan (range: > 0)"),
    (
        "negative learning rate",
        ["optim.lr=-1e-4"],
        None,
        "`optim.lr` must be positive, got -0.0001 (range: > 0)",
    ),
    ("Adam beta2 of 1", ["optim.beta2=1.0"], None, "`optim.beta2` must be below 1, got 1.0 (range: [0, 1))"),
    (
        "LoRA dropout 1.5",
        ["lora.dropout=1.5"],
        None,
        "`lora.dropout` must be below 1, got 1.5 (range: [0, 1))",
    ),
    ("max_length 8", ["data.max_length=8"], None, "`data.max_length` must be at least 32, got 8"),
    (
        "timeout 0",
        ["parallel.timeout_s=0"],
        None,
        "`parallel.timeout_s` must be positive, got 0 (range: [1, 31536000])",
    ),
    (
        "LoRA target the model lacks",
        ["lora.target_modules=q_proj,qkv_proj"],
        None,
        "`lora.target_modules` names qkv_proj, which micro does not have: its Linear layers are down_proj, "
        "gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj.",
    ),
    # `--calibrate RUN`: the pipeline's cut from a run's measured stage times.
    (
        "calibrate without a pipeline",
        lambda t: ["--strategy", "ddp", "--nproc", "2", "--calibrate", _timeline(t, [3, 1])],
        None,
        "re-cuts a pipeline's stages, but --strategy ddp has none: use --strategy pp, ddp+pp",
    ),
    (
        "calibrate from a run without a timeline",
        lambda t: [*PP, "--calibrate", str(t)],
        None,
        "no pipeline_timeline.json there. Every pipeline run (--strategy pp, ddp+pp, fsdp+pp or "
        "fsdp+tp+pp) writes it on its last step",
    ),
    (
        "calibrate from an older timeline",
        lambda t: [*PP, "--calibrate", _timeline(t, [3, 1], busy=False)],
        None,
        "has no stage_busy_s: it comes from a distft from before pipeline runs recorded",
    ),
    (
        "calibrate from a model of another depth",
        lambda t: [*PP, "--calibrate", _timeline(t, [3, 3])],
        None,
        "that run's model has 6 decoder layers, micro has 4",
    ),
    (
        "calibrate and pp_split",
        lambda t: [*PP, "--calibrate", _timeline(t, [3, 1]), "parallel.pp_split=[2,2]"],
        None,
        "and parallel.pp_split=[2,2] both set parallel.pp_split: keep one",
    ),
]


@pytest.mark.parametrize(
    ("argv", "setup", "phrase"), [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_input_is_refused_before_launch(argv, setup, phrase, tmp_path, monkeypatch, capsys):
    def launched(*args, **kwargs):
        raise AssertionError("a process was launched (or training started) for bad input")

    monkeypatch.setattr(subprocess, "call", launched)
    monkeypatch.setattr(subprocess, "Popen", launched)
    monkeypatch.setattr("distft.train.command.train", launched)  # the names `distft train` calls
    monkeypatch.setattr("distft.train.command.launch_ranks", launched)  # CPU ranks are forked, not Popen'd
    if setup:
        setup(monkeypatch)
    args = argv(tmp_path) if callable(argv) else argv
    if "--out" not in args and "--resume" not in args:
        args = [*args, "--out", str(tmp_path / "run")]
    start = time.perf_counter()
    assert main(["train", "--model", "micro", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (message,) = [line for line in err.splitlines() if line.startswith("distft train: error: ")]
    assert phrase in message, err  # the whole message is that one line: one paragraph
    assert time.perf_counter() - start < 60  # a hang guard, not a speed target: no network retries


def test_bad_input_table_is_large_enough():
    assert len(BAD_INPUTS) >= 40


def test_settings_the_strategy_ignores_are_warned_before_launch(tmp_path, monkeypatch, capsys):
    """A setting only other strategies read is valid but does nothing: one warning line each,
    printed before the checks that follow (here a refusal, so that nothing is launched)."""
    monkeypatch.setattr("distft.train.preflight._cuda_count", lambda: 0)
    argv = ["--strategy", "ddp", "--nproc", "2", "parallel.schedule=gpipe", "parallel.fsdp_wrap=model"]
    assert main(["train", "--model", "micro", *argv, "train.device=cuda", "--out", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "distft train: warning: parallel.fsdp_wrap=model does nothing under --strategy ddp: every strategy "
        "but single, ddp, zero1, tp, tp-sp, cp, pp, ddp+pp reads it.",
        "distft train: warning: parallel.schedule=gpipe does nothing under --strategy ddp: only pp, ddp+pp, "
        "fsdp+pp, fsdp+tp+pp read it.",
        "distft train: error: train.device=cuda, but this machine has no CUDA device; use train.device=cpu or auto.",
    ]
