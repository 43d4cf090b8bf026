"""SIGINT (Ctrl-C) and SIGTERM (a scheduler's notice): every rank stops after the same step, writes
a checkpoint, the main rank says where and how to resume in one line, exit code 130 / 143, no
traceback (`distft.signals`, docs/reliability.md "Signals").

The runs are real: `distft train` started as a user starts it (the console script, a session of
its own), the signal sent from outside once the first step is in metrics.jsonl; in a phase without
steps (a validation, the reference scoring, the export) a rank sends it at a batch
(`DISTFT_FAULT_SIGTERM_IN`, `tests.faults`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distft import signals
from tests.helpers import _kill_tree, _stacks_of_tree, distft, metrics, run_cli

RUN = [
    "--model", "micro",
    "train.max_steps=60",  # never reached: the signal stops it after a step or two
    "train.global_batch_size=2",
    "train.micro_batch_size=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "data.max_length=256",
    "data.max_rows=16",
    "output.save_base=false",
]  # fmt: skip


def signalled_run(out: Path, sig: int, to_group: bool, *args: str, timeout: float = 240):
    """`distft train RUN ARGS --out OUT`, sent `sig` (to its process group, or to the command
    alone) once step 1 is logged; (exit code, stdout, stderr). A hang fails with every stack."""
    cmd = [str(Path(sys.executable).parent / "distft"), "train", *RUN, *args, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    deadline = time.monotonic() + timeout
    log = out / "metrics.jsonl"
    try:
        while not (log.is_file() and log.read_text().strip()):
            assert proc.poll() is None, f"ended before step 1 ({proc.returncode}):\n{proc.communicate()[1]}"
            assert time.monotonic() < deadline, "no step 1 in time"
            time.sleep(0.05)
        (os.killpg if to_group else os.kill)(proc.pid, sig)
        stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except (AssertionError, subprocess.TimeoutExpired) as err:
        stacks = _stacks_of_tree(proc.pid)
        _kill_tree(proc.pid)
        proc.communicate()
        raise AssertionError(f"{err}\n{stacks}") from None
    return proc.returncode, stdout, stderr


def stop_line(code: int, stdout: str, stderr: str, want_code: int) -> str:
    """The exit code, no traceback, and the one line that says the run stopped."""
    assert code == want_code, stderr[-3000:]
    assert "Traceback" not in stdout + stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("distft train: stopped")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def check_stopped(out: Path, code: int, stdout: str, stderr: str, sig_name: str, want_code: int) -> int:
    """The one line, the exit code, no traceback, a checkpoint at the step named; that step."""
    line = stop_line(code, stdout, stderr, want_code)
    step = int(line.split(" after step ")[1].split()[0])
    checkpoint = out / "checkpoints" / f"step-{step:06d}"
    assert line == (
        f"distft train: stopped by {sig_name} after step {step} of 60; checkpoint written to {checkpoint}. "
        f"Resume with: distft train --resume {out}"
    )
    assert (checkpoint / "trainer.json").is_file() and not (out / "adapter").exists()
    assert 1 <= step < 60 and [m["step"] for m in metrics(out)] == list(range(1, step + 1))
    return step


def resume_to_the_end(out: Path, step: int, *args: str) -> None:
    """`distft train --resume OUT` continues at step + 1 and finishes (two more steps)."""
    proc = distft("train", "--resume", str(out), "--max-steps", str(step + 2), *args)
    assert f"resuming from {out / 'checkpoints' / f'step-{step:06d}'} (step {step})" in proc.stdout
    assert [m["step"] for m in metrics(out)] == list(range(1, step + 3))
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_sigterm_stops_a_single_process_run_at_a_step_and_it_resumes(tmp_path):
    out = tmp_path / "single"
    code, stdout, stderr = signalled_run(out, signal.SIGTERM, False, "--strategy", "single")
    step = check_stopped(out, code, stdout, stderr, "SIGTERM", 143)
    resume_to_the_end(out, step)


def test_ctrl_c_to_every_process_stops_both_ddp_ranks_at_one_step(tmp_path):
    """SIGINT to the whole process group, as Ctrl-C in a terminal: the launcher's agent and both
    ranks get it (and the ranks again, forwarded by the agent); one line, exit code 130."""
    out = tmp_path / "ddp"
    code, stdout, stderr = signalled_run(out, signal.SIGINT, True, "--strategy", "ddp", "--nproc", "2")
    step = check_stopped(out, code, stdout, stderr, "SIGINT", 130)
    assert "death signal" not in stderr and "Closing process" not in stderr  # the agent's notes
    resume_to_the_end(out, step, "--strategy", "single", "--nproc", "1")  # ddp resumes in one process


# ---- a phase without steps: the ranks agree before each of its batches ------------------------

# Two steps, validated after the last one only; no checkpoints asked for (the last step's is written anyway).
FINAL = [*RUN, "train.max_steps=2", "train.eval_batches=2", "data.max_length=192"]


def test_sigterm_after_the_last_step_stops_both_ddp_ranks_at_one_batch_and_the_resume_finishes(tmp_path):
    """SIGTERM as the final validation's first batch begins, sent by rank 1 to itself and to the
    launcher, which forwards it to rank 0: both ranks stop before that batch (a batch after the
    signal would fail the run: `tests.faults`), with the last step's checkpoint, written before
    its validation. Resumed in one process, the validation is recorded and a SIGTERM before the
    export stops it the same way; the last resume only exports."""
    out = tmp_path / "ddp"
    then = f"checkpoint written to {out / 'checkpoints' / 'step-000002'}. Resume with: distft train --resume {out}"
    signal = {"DISTFT_FAULT_SIGTERM_IN": "validation"}
    proc = run_cli("train", *FINAL, "--strategy", "ddp", "--nproc", "2", "--out", str(out), env=signal)
    line = stop_line(proc.returncode, proc.stdout, proc.stderr, 143)
    assert line == f"distft train: stopped by SIGTERM after step 2 of 2, before its final validation; {then}"
    assert [m["step"] for m in metrics(out)] == [1] and not (out / "adapter").exists()

    single, signal = (
        ["--strategy", "single", "--nproc", "1"],
        {"DISTFT_FAULT_SIGTERM_IN": "export", "DISTFT_FAULT_RANK": "0"},
    )
    proc = run_cli("train", "--resume", str(out), *single, env=signal)
    line = stop_line(proc.returncode, proc.stdout, proc.stderr, 143)
    assert line == f"distft train: stopped by SIGTERM after step 2 of 2, before the export; {then}"
    assert [(m["step"], "eval_loss" in m) for m in metrics(out)] == [(1, False), (2, True)]
    distft("train", "--resume", str(out), *single)
    assert [m["step"] for m in metrics(out)] == [1, 2] and (
        out / "adapter" / "adapter_model.safetensors"
    ).is_file()
    assert not (out / "checkpoints").exists()  # written only so that a failure at the end costs nothing


def test_sigterm_in_the_reference_scoring_stops_before_its_next_batch_and_nothing_is_lost(tmp_path):
    """DPO's reference scored before step 1: a SIGTERM there stops before the next batch of pairs,
    in the line (and exit code) of a stop before the first step; a resume starts the run over."""
    out = tmp_path / "dpo"
    dpo = [*FINAL, "--data", "sample-pairs", "--objective", "dpo", "dpo.precompute_reference=true"]
    signal = {"DISTFT_FAULT_SIGTERM_IN": "reference", "DISTFT_FAULT_RANK": "0"}
    proc = run_cli("train", *dpo, "--out", str(out), env=signal)
    assert stop_line(proc.returncode, proc.stdout, proc.stderr, 143) == (
        "distft train: stopped by SIGTERM before the first step; no step ran, and nothing was left half-written."
    )
    assert not (out / "reference_logps.safetensors").exists() and not (out / "metrics.jsonl").exists()
    distft("train", "--resume", str(out))
    assert (out / "reference_logps.safetensors").is_file() and [m["step"] for m in metrics(out)] == [1, 2]


# ---- the handler itself, in this process -------------------------------------------------------


def test_the_handler_raises_before_the_loop_records_inside_and_ignores_the_echo():
    before = signal.getsignal(signal.SIGINT)
    with signals.handling():
        with pytest.raises(signals.Interrupted) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs at the next bytecode, long before this ends
        assert stop.value.signum == signal.SIGTERM and signals.exit_code(stop.value.signum) == 143
    assert signals.received() is None  # each `handling` starts afresh, and the old state is back
    with signals.handling(), signals.deferred():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the launcher forwarding the same: not a second Ctrl-C
        time.sleep(0.1)
        assert signals.received() == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is before  # the caller's handler again
