"""One writer per run directory: a live holder refuses a second, a dead one's lock is taken over,
the holder's own ranks pass, and `distft train` is refused before anything is written."""

import json
import os
import socket
import subprocess
import sys
import time

import psutil
import pytest

from distft.cli import main
from distft.errors import RunLockedError
from distft.io.lock import LOCK_ENV, LOCK_FILE, run_lock


def plant_lock(directory, pid, host=None, start=None):
    directory.mkdir(parents=True, exist_ok=True)
    holder = {
        "pid": pid,
        "host": host or socket.gethostname(),
        "since": time.time(),
        "process_start": start if start is not None else psutil.Process(pid).create_time(),
        "command": "distft train",
        "token": "0123",
    }
    (directory / LOCK_FILE).write_text(json.dumps(holder))


def test_the_lock_is_held_for_the_block_and_released_however_it_ends(tmp_path):
    with pytest.raises(RuntimeError), run_lock(tmp_path / "run"):
        held = json.loads((tmp_path / "run" / LOCK_FILE).read_text())
        assert held["pid"] == os.getpid() and os.environ[LOCK_ENV] == held["token"]
        with run_lock(tmp_path / "run"):  # the holder's own ranks (same token) pass
            pass
        raise RuntimeError("the run failed")
    assert not (tmp_path / "run" / LOCK_FILE).exists() and LOCK_ENV not in os.environ


def test_a_live_holder_refuses_a_second_writer(tmp_path):
    plant_lock(tmp_path, os.getppid())  # a process that runs: pytest's parent
    with (
        pytest.raises(RunLockedError, match=rf"is in use: distft train \(pid {os.getppid()} on"),
        run_lock(tmp_path),
    ):
        pass
    assert (tmp_path / LOCK_FILE).exists()  # not taken from its holder


def test_another_hosts_lock_is_refused_with_how_to_remove_it(tmp_path):
    plant_lock(tmp_path, 1, host="node-7", start=0)
    with (
        pytest.raises(RunLockedError, match=rf"on node-7.*delete {tmp_path / LOCK_FILE}"),
        run_lock(tmp_path),
    ):
        pass


def test_another_hosts_lock_is_taken_over_once_its_heartbeat_stops(tmp_path, capsys, monkeypatch):
    import distft.io.lock as lock

    plant_lock(tmp_path, 1, host="node-7", start=0)
    old = time.time() - lock.STALE_S - 60  # its holder stopped touching it 11 minutes ago
    os.utime(tmp_path / LOCK_FILE, (old, old))
    monkeypatch.setattr(lock, "HEARTBEAT_S", 0.05)
    with run_lock(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["host"] == socket.gethostname()
        os.utime(tmp_path / LOCK_FILE, (old, old))
        time.sleep(0.5)  # the holder's heartbeat touches it again
        assert time.time() - (tmp_path / LOCK_FILE).stat().st_mtime < 5
    err = capsys.readouterr().err
    assert "took over the stale lock" in err and "on node-7" in err


@pytest.mark.parametrize("reused_pid", [False, True], ids=["dead-pid", "pid-reused-by-another-process"])
def test_a_stale_lock_is_taken_over_with_one_line(tmp_path, capsys, reused_pid):
    if reused_pid:  # a live pid, started after the lock was written: not its holder
        plant_lock(tmp_path, os.getppid(), start=psutil.Process(os.getppid()).create_time() - 100)
    else:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        plant_lock(tmp_path, dead.pid, start=0)
    with run_lock(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert "took over the stale lock" in capsys.readouterr().err


def test_train_into_a_directory_another_run_writes_is_refused_before_anything(tmp_path, capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from distft.io.lock import run_lock\n"
         f"with run_lock({str(out)!r}):\n    print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["train", "--model", "micro", "--out", str(out)]) == 2
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert f"distft train: error: {out} is in use: distft train (pid {holder.pid}" in err
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # nothing written beside it


def test_a_planted_lock_link_makes_nothing_outside_the_run_written(tmp_path, capsys):
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).symlink_to(outside)  # not a lock: a link to a file elsewhere
    with run_lock(run):
        assert not (run / LOCK_FILE).is_symlink()
    assert outside.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == [
        "precious.txt",
        "run",
    ]
    assert "took over the stale lock" in capsys.readouterr().err
