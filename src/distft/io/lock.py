"""One writer per run directory: `DIR/.lock`.

Two `distft train` runs with the same `--out` would interleave their metrics, prune each other's
checkpoints and export over each other. The command that starts a run writes its pid, host, start
time and a token to a file of its own and hard-links it as `DIR/.lock` (atomic, and complete when
it appears: of two processes, one links it and the other finds it), and removes it when the run
ends, however it ends. A second writer finds the lock and is refused, naming the holder.

A lock whose process is gone (a `kill -9`, a machine that rebooted) is stale: on the same host the
pid is looked up (its start time too, so a reused pid is not mistaken for the holder), and a dead
holder's lock is taken over with one line. A holder on another host (a multi-node run on a shared
filesystem) cannot be looked up from here; instead every holder touches its lock every
`HEARTBEAT_S`, and another host's lock untouched for `STALE_S` is stale: its holder is gone (a
filesystem's clock may lag a host's by seconds, never by minutes).

The ranks a command launches are part of its run: they inherit the token in `DISTFT_RUN_LOCK`
and take no lock of their own. A Python caller of `distft.train` gets the same lock from `train`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from distft.errors import RunLockedError

LOCK_FILE = ".lock"
LOCK_ENV = "DISTFT_RUN_LOCK"  # the holder's token, inherited by the ranks it launches
HEARTBEAT_S = 30.0  # a holder touches its lock this often
STALE_S = 600.0  # another host's lock untouched this long: its holder is gone


def _holder_alive(holder: dict, path: Path) -> bool:
    """Whether the process that wrote `holder` still runs: looked up on this host, else its heartbeat."""
    if holder.get("host") != socket.gethostname():
        try:
            return time.time() - path.stat().st_mtime < STALE_S
        except FileNotFoundError:
            return False
    try:
        process = psutil.Process(int(holder["pid"]))
        return abs(process.create_time() - float(holder.get("process_start", 0))) < 1.0
    except (psutil.NoSuchProcess, ValueError, KeyError, TypeError):
        return False
    except psutil.AccessDenied:  # another user's process: running
        return True


def _read(path: Path) -> dict | None:
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # damaged (it appears whole, by a link): nobody holds it
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("since", 0))))
    return f"{holder.get('command', 'a distft command')} (pid {holder.get('pid')} on {holder.get('host')}, since {since})"


@contextlib.contextmanager
def run_lock(directory: Path, command: str = "distft train") -> Iterator[None]:
    """Hold `directory`'s lock for the block, unless this process belongs to the holder's run."""
    directory = Path(directory)
    path = directory / LOCK_FILE
    held = _read(path)
    if held and held.get("token") and held.get("token") == os.environ.get(LOCK_ENV):
        yield  # a rank (or an in-process `train`) of the run that holds it
        return
    created = not directory.exists()
    token = _acquire(directory, path, command)
    previous = os.environ.get(LOCK_ENV)
    os.environ[LOCK_ENV] = token
    stop = threading.Event()
    threading.Thread(target=_heartbeat, args=(path, token, stop), name="distft-lock", daemon=True).start()
    try:
        yield
    finally:
        stop.set()
        if previous is None:
            os.environ.pop(LOCK_ENV, None)
        else:
            os.environ[LOCK_ENV] = previous
        if (_read(path) or {}).get("token") == token:
            path.unlink(missing_ok=True)
        if created and directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()  # a command refused before it wrote anything leaves no directory


def _heartbeat(path: Path, token: str, stop: threading.Event) -> None:
    """Touch the lock while this run holds it, so another host can tell it from a dead one's."""
    while not stop.wait(HEARTBEAT_S):
        if (_read(path) or {}).get("token") != token:
            return  # released, or taken over
        with contextlib.suppress(OSError):  # a full or read-only disk: the run itself will say
            os.utime(path)


def _acquire(directory: Path, path: Path, command: str) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(8)
    me = psutil.Process()
    holder = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.time(),
        "process_start": me.create_time(),
        "command": command,
        "token": token,
    }
    mine = directory / f".lock.{token}"
    mine.write_text(json.dumps(holder), encoding="utf-8")
    try:
        return _link(mine, path, directory, token)
    finally:
        mine.unlink(missing_ok=True)


def _link(mine: Path, path: Path, directory: Path, token: str) -> str:
    for _ in range(3):  # a stale lock removed by us (or another taker) is retried
        try:
            os.link(mine, path)
        except FileExistsError:
            found = _read(path)
            if found is None:
                continue  # released just now
            if found and _holder_alive(found, path):
                raise RunLockedError(
                    f"{directory} is in use: {_describe(found)} is writing it. Two runs in one directory "
                    f"would corrupt each other; wait for it to finish, or use another --out. If that "
                    f"process is gone (a crash on another machine), delete {path} and run again, or wait: "
                    f"a lock untouched for {STALE_S / 60:g} minutes is taken over."
                ) from None
            what = f"left by {_describe(found)}, which is gone" if found else "written half-way"
            print(f"distft: took over the stale lock of {directory} ({what})", file=sys.stderr, flush=True)
            path.unlink(missing_ok=True)
            continue
        return token
    raise RunLockedError(f"{directory} is in use: its lock {path} changed hands while this run waited.")
