"""Shared by the multi-process tests: run `distft train` for real and read what it wrote."""

from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing
import multiprocessing.forkserver
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch
from safetensors.torch import load_file
from transformers.conversion_mapping import get_checkpoint_conversion_mapping

from distft.cli import COMMANDS, command, main
from distft.data import qwen3_tokenizer
from distft.model import causal_lm
from distft.model.presets import MICRO_RANKS
from distft.parallel.base import unwrap
from distft.plan.expected import expected_step_bytes
from distft.plan.model_spec import spec_from_config
from distft.train.hooks import HOOKS_VARIABLE
from distft.train.metrics import START_ENV, truncate_metrics
from tests import faults

ROOT = Path(__file__).resolve().parents[1]  # the checkout: `tests` is a package in it

# Small enough for two CPU cores, big enough to exercise accumulation: global batch 4 = micro 1
# x 2 accumulation steps x 2 ranks (and x 4 accumulation steps in the single-process reference).
LEARNING_RATE = 1e-3
PARITY = [
    "--model", "micro",
    "train.max_steps=3",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "data.max_length=384",
    "data.max_rows=32",
    "optim.warmup_steps=1",
    f"optim.lr={LEARNING_RATE}",
    # Adam's eps above the rounding of a gradient element: at micro's size some adapter gradients
    # are ~1e-9, where eps=1e-8 lets a 1e-7 summation-order difference flip a whole step.
    "optim.eps=1e-6",
]  # fmt: skip


def distft(
    *args: str, timeout: int = 300, env: dict | None = None, fresh: bool = False, cwd: Path | None = None
):
    """`run_cli`, failing the test on a non-zero exit code."""
    proc = run_cli(*args, timeout=timeout, env=env, fresh=fresh, cwd=cwd)
    if proc.returncode != 0:
        raise AssertionError(
            f"distft {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def run_cli(
    *args: str, timeout: int = 300, env: dict | None = None, fresh: bool = False, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """`distft ARGS` as a user runs it, in a process of its own (in `cwd` if given), its output
    captured: forked from a server that imported distft once, or with `fresh`, a new interpreter
    (for what a user sees from start to end). A Python start with torch, transformers and peft costs ~5 s of CPU, and the suite
    runs hundreds of commands on 2 cores. A multi-process `distft train` forks its ranks from that
    process, as it does on any CPU (`distft.launch`)."""
    run_env = _environment(env)
    if fresh:
        cmd = [str(Path(sys.executable).parent / "distft"), *args]  # the console script users run
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=run_env, cwd=cwd)
    with tempfile.TemporaryDirectory(prefix="distft-run-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        proc = _fork(_run_cli, list(args), run_env, str(out), str(err), str(cwd or Path.cwd()))
        proc.join(timeout)
        if proc.exitcode is None:
            stacks = _stop_hung(proc)
            raise subprocess.TimeoutExpired(
                ["distft", *args], timeout, out.read_text(), err.read_text() + "\n" + stacks
            )
        # A negative exit code: killed by that signal, as subprocess reports it.
        return subprocess.CompletedProcess(["distft", *args], proc.exitcode, out.read_text(), err.read_text())


def _environment(extra: dict | None) -> dict[str, str]:
    """This process's environment for a run: one thread, `extra` on top, no start stamp (the CLI
    stamps its own start; each run has its own). A DISTFT_FAULT_* variable in `extra` installs the
    faults of `tests.faults` through distft's `DISTFT_HOOKS`, with this checkout on PYTHONPATH for
    ranks that start a fresh interpreter."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra or {})}
    env.pop(START_ENV, None)
    if any(name.startswith(faults.PREFIX) for name in extra or {}):
        env[HOOKS_VARIABLE] = faults.HOOKS
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


# The server the runs fork from: a fresh interpreter that imported the CLI (through this module)
# and nothing else. A process that has trained or joined a process group is no safe parent for a
# fork, which is why the test process itself is not one.
_SERVER = multiprocessing.get_context("forkserver")
_SERVER.set_forkserver_preload(["tests.helpers"])
qwen3_tokenizer()  # loaded once here (~1 s), inherited by every run forked from the server
qwen3_tokenizer(MICRO_RANKS)  # the micro presets' (`distft.model.presets`)
for _command in COMMANDS:  # each command's module, which the CLI imports only when the command runs
    command(_command)
# transformers' table of checkpoint renamings, which peft builds at a process's first adapter
# (~0.2 s of CPU): built here once instead of in every rank of every run.
get_checkpoint_conversion_mapping("qwen3")
# Everything imported so far frozen out of the collector (as `distft.launch` does before it forks
# ranks): the full collection at the end of every run (`distft.train.loop`) then walks only what
# the run made, 2 ms instead of 0.3 s, here and in every run forked from the server.
gc.collect()
gc.freeze()


def _start_server() -> None:
    """Start the fork server (once per test process), with torch's thread count set before it loads."""
    saved = dict(os.environ)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _fork(target: Callable[..., None], *args: Any) -> multiprocessing.Process:
    """`target(*args)` in a process forked from the server, started."""
    _start_server()
    proc = _SERVER.Process(target=target, args=args)
    proc.start()
    return proc


def in_forked_process(fn: Callable[..., Any], *args: Any, timeout: int = 300) -> Any:
    """`fn(*args)` in a process forked from the server (imports done, no process group), for a
    test that must join a group or train in-process; its return value comes back."""
    receive, send = _SERVER.Pipe(duplex=False)
    proc = _fork(_call, fn, args, send)
    send.close()
    if not receive.poll(timeout):
        raise TimeoutError(f"{fn.__name__} ran past {timeout} s\n{_stop_hung(proc)}")
    try:
        ok, value = receive.recv()
    except EOFError:
        proc.join()
        ok, value = False, f"the process ended without an answer (exit code {proc.exitcode})"
    proc.join()
    if not ok:
        raise AssertionError(f"{fn.__name__} failed in its process:\n{value}")
    return value


def spawn(fn: Callable[..., None], args: tuple, nprocs: int, timeout: int = 300) -> None:
    """`fn(rank, *args)` in `nprocs` processes forked from the server, as `torch.multiprocessing.spawn`
    runs it in fresh interpreters (each ~5 s of CPU in imports). Their output comes back to this
    process's stdout and stderr, rank by rank. Fails the test if any process fails (its traceback
    is on stderr) or they run past `timeout` (with their stacks)."""
    with tempfile.TemporaryDirectory(prefix="distft-spawn-") as tmp:
        files = [(Path(tmp, f"{rank}.out"), Path(tmp, f"{rank}.err")) for rank in range(nprocs)]
        procs = [_fork(_with_output_in, str(o), str(e), fn, rank, *args) for rank, (o, e) in enumerate(files)]
        _wait(procs, timeout, grace=30)
        hung = [_stop_hung(p) for p in procs if p.exitcode is None]
        for p in procs:
            p.join()
        for out, err in files:
            sys.stdout.write(out.read_text())
            sys.stderr.write(err.read_text())
    if hung or any(p.exitcode for p in procs):
        codes = [p.exitcode for p in procs]
        raise AssertionError(f"{fn.__name__} failed (exit codes by rank: {codes})\n" + "\n".join(hung))


def _with_output_in(stdout: str, stderr: str, fn: Callable[..., None], *args: Any) -> None:
    _redirect(stdout, stderr)
    fn(*args)


def _redirect(stdout: str, stderr: str) -> None:
    """Descriptors 1 and 2 on these files, and Python's streams on them."""
    for fd, path in ((1, stdout), (2, stderr)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(file, fd)
        os.close(file)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115


def _call(fn: Callable[..., Any], args: tuple, send) -> None:
    try:
        send.send((True, fn(*args)))
    except BaseException:  # everything goes back to the test, its traceback included
        send.send((False, traceback.format_exc()))


def _run_cli(args: list[str], env: dict[str, str], stdout: str, stderr: str, cwd: str | None = None) -> None:
    """In the forked process: the environment, the directory, descriptors 1 and 2 on the files, then the CLI."""
    if cwd:
        os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    _redirect(stdout, stderr)
    sys.exit(main(args))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agents(
    *args: str, nnodes: int = 2, timeout: int = 400, grace: int = 20, env: dict | None = None
) -> list[tuple[int | None, str]]:
    """Run `distft ARGS` as `nnodes` separate agents, as on `nnodes` machines: each its own torchrun
    with `--nnodes N --node-rank R`, meeting at a free port on 127.0.0.1. Returns each agent's exit
    code (None: killed by a signal) and output. Every agent is killed, with all its ranks, once
    `timeout` passes, or `grace` seconds after one agent failed (its peers may wait in a collective
    for parallel.timeout_s): a hang fails the test instead of blocking the suite."""
    endpoint = f"127.0.0.1:{free_port()}"
    run_env = _environment(env)
    with tempfile.TemporaryDirectory(prefix="distft-agents-") as tmp:
        logs = [Path(tmp, f"node-{n}.log") for n in range(nnodes)]
        placement = ["--nnodes", str(nnodes), "--rdzv-endpoint", endpoint]
        nodes = [
            _fork(_run_cli, [*args, *placement, "--node-rank", str(node)], run_env, str(log), str(log))
            for node, log in enumerate(logs)
        ]
        try:
            _wait(nodes, timeout, grace)
            if all(p.exitcode is None for p in nodes):  # a hang, not a failed peer: say where
                logs[0].write_text(logs[0].read_text() + "\n" + _stacks_of_tree(nodes[0].pid))
        finally:
            for p in nodes:
                if p.exitcode is None:
                    _kill_tree(p.pid)
                    p.join()
        outputs = [log.read_text() for log in logs]
    return [(p.exitcode if p.exitcode >= 0 else None, out) for p, out in zip(nodes, outputs, strict=True)]


def _wait(procs: list[multiprocessing.Process], timeout: float, grace: float) -> None:
    """Until every process has exited, `timeout` has passed, or `grace` since the first failure."""
    deadline, failed_at = time.monotonic() + timeout, None
    while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
        if failed_at is None and any(p.exitcode for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() > failed_at + grace:
            return
        time.sleep(0.1)


def _stop_hung(proc: multiprocessing.Process) -> str:
    """Kill a hung process and everything under it; their stacks, taken first."""
    stacks = _stacks_of_tree(proc.pid)
    _kill_tree(proc.pid)
    proc.join()
    return stacks


def _stacks_of_tree(pid: int) -> str:
    """Every thread's Python and native stack in process `pid` and all under it (py-spy), so a run
    that hung in CI says where."""
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        dumps = []
        for proc in [root, *root.children(recursive=True)]:
            cmd = [str(Path(sys.executable).parent / "py-spy"), "dump", "--native", "--pid", str(proc.pid)]
            try:
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
                dumps.append(run.stdout + run.stderr)
            except (OSError, subprocess.TimeoutExpired) as err:
                dumps.append(f"pid {proc.pid}: no stack ({err})")
        return "stacks of the hung processes:\n" + "\n".join(dumps)
    return "the hung process ended before its stacks were taken"


def _kill_tree(pid: int) -> None:
    """SIGKILL an agent and every process under it (torchrun starts each rank in a session of its
    own, so killing the agent's process group would miss them)."""
    try:
        root = psutil.Process(pid)
        tree = [*root.children(recursive=True), root]  # listed before any dies and is re-parented
    except psutil.NoSuchProcess:
        return
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


def write_jsonl(path: Path, records: list) -> Path:
    """`records` as a JSON-lines file at `path`."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def crashed_copy(run: Path, out: Path, after_step: int) -> Path:
    """`run` as a crash during step `after_step + 1` leaves it, copied to `out`: no exported adapter
    or model, no checkpoint past `after_step` (the last step's included), no step record past it."""

    def later(folder: str, names: list[str]) -> list[str]:
        if Path(folder) == run:
            return [n for n in names if n in ("adapter", "model")]
        return [n for n in names if n.startswith("step-") and int(n.removeprefix("step-")) > after_step]

    shutil.copytree(run, out, ignore=later)
    truncate_metrics(out / "metrics.jsonl", after_step)
    return out


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "adapter" / "adapter_model.safetensors")


def assert_same_training(run: Path, reference: Path, rtol: float = 1e-5) -> None:
    """Per-step losses and every final adapter tensor equal the reference run's, to `rtol` (fp32).

    Tensors are compared by relative norm of the difference. An element-wise test would be unfair
    to any parallel run: Adam divides each gradient by its own running magnitude, so an element
    whose gradient is ~0 (lora_A's are exactly 0 on the first step, while lora_B is still 0) turns
    a 1e-7 summation-order difference into a visible one, whatever the strategy.
    """
    got, want = metrics(run), metrics(reference)
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for g, w in zip(got, want, strict=True):
        assert abs(g["loss"] - w["loss"]) <= rtol * abs(w["loss"]), (g["step"], g["loss"], w["loss"])
        # The gradient norm catches a gradient off by a constant factor, which Adam would absorb.
        assert abs(g["grad_norm"] - w["grad_norm"]) <= rtol * w["grad_norm"], (
            g["step"],
            g["grad_norm"],
            w["grad_norm"],
        )
    a, b = adapter(run), adapter(reference)
    assert a.keys() == b.keys() and a
    for name in b:
        error = (a[name] - b[name]).norm() / b[name].norm()
        if error <= rtol:
            continue
        # Adam's cancellation: an element whose gradient changed sign between steps ends near 0 as
        # the difference of two lr-sized moves, so ordering noise in its gradient shows up in full.
        # Tolerate it in at most one element per thousand (one, in a smaller tensor), and by at most
        # 1% of one step; a wrong gradient moves many elements by a whole step.
        off = (a[name] - b[name]).abs() > rtol * b[name].norm()
        assert off.sum() <= max(1, off.numel() // 1000), f"{name}: relative difference {error:.2e}"
        assert (a[name] - b[name]).abs().max() <= 1e-2 * LEARNING_RATE, f"{name}: {error:.2e}"


def expected_bytes(cfg, strategy, model: torch.nn.Module, batches: list[dict]) -> dict[str, int]:
    """The bytes formula (`distft.plan.expected`) for a strategy run in this process on `batches`,
    the built model's architecture read as a run reads it."""
    spec = spec_from_config(causal_lm(unwrap(model).lm).config.to_dict(), cfg.model.name, "test")
    return expected_step_bytes(cfg, strategy, model, spec, batches)[0]
