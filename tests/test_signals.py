"""SIGINT (Ctrl-C) and SIGTERM (a scheduler's notice): every rank stops after the same step, writes
a checkpoint, the main rank says where and how to resume in one line, exit code 130 / 143, no
traceback (`distft.signals`, docs/reliability.md "Signals").

The runs are real: `distft train` started as a user starts it (the console script, a session of
its own), the signal sent from outside once the first step is in metrics.jsonl."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distft import signals
from tests.helpers import _kill_tree, _stacks_of_tree, distft, metrics

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


def check_stopped(out: Path, code: int, stdout: str, stderr: str, sig_name: str, want_code: int) -> int:
    """The one line, the exit code, no traceback, a checkpoint at the step named; that step."""
    assert code == want_code, stderr[-3000:]
    assert "Traceback" not in stdout + stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("distft train: stopped")]
    assert len(lines) == 1, stderr[-3000:]
    step = int(lines[0].split(" after step ")[1].split()[0])
    checkpoint = out / "checkpoints" / f"step-{step:06d}"
    assert lines[0] == (
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
