"""Every command ends in `distft.exits.run_command`: one line on stderr and an exit code, whatever escapes;
DISTFT_DEBUG=1 adds the traceback."""

import pytest
import torch

from distft.errors import CheckpointError, ConfigError, DamagedFileError
from distft.exits import DEBUG_ENV, run_command
from tests.helpers import run_cli


def fail(err: BaseException):
    def handler() -> int:
        raise err

    return handler


@pytest.mark.parametrize(
    "err, code, line",
    [
        (ConfigError("optim.lr must be positive."), 2, "distft train: error: optim.lr must be positive.\n"),
        (DamagedFileError("adapter is damaged."), 2, "distft train: error: adapter is damaged.\n"),
        (CheckpointError("writing failed."), 1, "distft train: error: writing failed.\n"),
        (
            OSError(28, "No space left on device", "runs/a/metrics.jsonl"),
            1,
            "distft train: error: OSError: [Errno 28] No space left on device: 'runs/a/metrics.jsonl'. "
            f"Rerun with {DEBUG_ENV}=1 for the traceback.\n",
        ),
        (
            KeyError("lm_head"),
            1,
            "distft train: error: KeyError: 'lm_head'. This is unexpected (a bug in distft, or a fault it "
            f"does not know): rerun with {DEBUG_ENV}=1 for the traceback, and report it.\n",
        ),
    ],
    ids=["config", "damaged", "training", "os", "unexpected"],
)
def test_a_failure_is_one_line_and_an_exit_code(err, code, line, capsys, monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert run_command("train", fail(err)) == code
    assert capsys.readouterr().err == line


def test_debug_prints_the_traceback_too(capsys, monkeypatch):
    monkeypatch.setenv(DEBUG_ENV, "1")
    assert run_command("eval", fail(ConfigError("bad --rows."))) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.endswith("distft eval: error: bad --rows.\n")
    with pytest.raises(KeyError):  # a bug, under DISTFT_DEBUG: the real exception, as Python shows it
        run_command("eval", fail(KeyError("x")))


def test_debug_in_a_rank_prints_the_traceback_and_the_line_and_exits(capsys, monkeypatch):
    """A rank's launcher keeps a raised exception to itself: under DISTFT_DEBUG a rank prints both."""
    monkeypatch.setenv(DEBUG_ENV, "1")
    monkeypatch.setenv("RANK", "1")
    assert run_command("train", fail(KeyError("lm_head"))) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "KeyError: 'lm_head'\n" in err
    assert err.endswith("distft train: error: KeyError: 'lm_head'. Its traceback is above.\n")


def test_debug_shows_a_failing_ranks_traceback_in_a_multi_process_run(tmp_path):
    """A bug in rank 1 of a real 2-rank run (`tests.faults`): its traceback and its line reach the
    user, before the launcher's summary."""
    proc = run_cli(
        "train", "--strategy", "ddp", "--nproc", "2", "--model", "micro", "train.max_steps=2",
        "train.eval_batches=0", "data.max_length=256", "data.max_rows=16", "output.checkpoint_every=0",
        "--out", str(tmp_path / "run"),
        env={DEBUG_ENV: "1", "DISTFT_FAULT_RAISE_AT_STEP": "2"},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert 'raise KeyError("a planted fault")' in proc.stderr  # rank 1's traceback
    assert "distft train: error: KeyError: 'a planted fault'. Its traceback is above." in proc.stderr
    assert "distft: the run failed." in proc.stderr  # which rank ended first is a race


def test_only_rank_0_reports_an_error_every_rank_raises(capsys, monkeypatch):
    class Diverged(CheckpointError):
        every_rank = False

    monkeypatch.setenv("RANK", "1")
    assert run_command("train", fail(Diverged("step 3 diverged."))) == 1
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "err, said",
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "CUDA out of memory"),
        (MemoryError(), "MemoryError"),
        (
            RuntimeError(
                "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory: you tried"
            ),
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory",
        ),
    ],
    ids=["cuda", "python", "cpu-allocator"],
)
def test_running_out_of_memory_is_one_line_naming_memory_and_the_ways_out(err, said, capsys, monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    monkeypatch.setenv("RANK", "1")  # said by the rank that ran out, whichever it is
    assert run_command("train", fail(err)) == 1
    line = capsys.readouterr().err
    assert line.startswith(f"distft train: error: out of memory ({said}") and line.count("\n") == 1
    assert "model.activation_checkpointing=full" in line and "--dry-run" in line and "unexpected" not in line
