"""Shared by the multi-process tests: run `distft train` for real and read what it wrote."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

from distft.cli import main
from distft.train.metrics import START_ENV

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
]  # fmt: skip


def distft(*args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the CLI as a user would: `distft train` of a multi-process strategy in this process (its
    checks before launch, then torchrun in a subprocess, as the CLI does), everything else in a
    fresh process. A Python start with torch, transformers and peft costs ~5 s of CPU; the suite
    launches well over a hundred runs on 2 cores."""
    run_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    if _launches_ranks(args):
        proc = _in_process(list(args), run_env)
    else:
        proc = subprocess.run(
            [sys.executable, "-m", "distft.cli", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **run_env},
        )
    if proc.returncode != 0:
        raise AssertionError(
            f"distft {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def _launches_ranks(args: tuple[str, ...]) -> bool:
    """`distft train --strategy S` with S not single: the ranks run under torchrun anyway."""
    if not args or args[0] != "train" or "--strategy" not in args:
        return False
    return args[args.index("--strategy") + 1] != "single"


def _in_process(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`main(args)` with the environment set for it and restored after, and the output of this
    process and of its children (torchrun's ranks write to the inherited descriptors 1 and 2)
    captured in files, as `subprocess.run(capture_output=True)` would."""
    saved_env = dict(os.environ)
    os.environ.update(env)
    os.environ.pop(START_ENV, None)  # the CLI stamps its start; each run has its own
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, name) for name in ("stdout", "stderr")]
        files = [open(path, "a", buffering=1, encoding="utf-8") for path in paths]  # noqa: SIM115
        sys.stdout.flush(), sys.stderr.flush()
        saved_fds = [os.dup(1), os.dup(2)]
        saved_streams = sys.stdout, sys.stderr
        try:
            os.dup2(files[0].fileno(), 1)
            os.dup2(files[1].fileno(), 2)
            sys.stdout, sys.stderr = files
            try:
                code = main(args)
            except SystemExit as exit:  # argparse's usage errors
                code = exit.code if isinstance(exit.code, int) else 1
        finally:
            sys.stdout, sys.stderr = saved_streams
            for fd, saved in zip((1, 2), saved_fds, strict=True):
                os.dup2(saved, fd)
                os.close(saved)
            for f in files:
                f.close()
            os.environ.clear()
            os.environ.update(saved_env)
        out, err = (Path(path).read_text(encoding="utf-8", errors="replace") for path in paths)
    return subprocess.CompletedProcess(["distft", *args], code, out, err)


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
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with tempfile.TemporaryDirectory(prefix="distft-agents-") as tmp, contextlib.ExitStack() as files:
        logs = [files.enter_context(open(Path(tmp) / f"node-{n}.log", "w+")) for n in range(nnodes)]
        placement = ["--nnodes", str(nnodes), "--rdzv-endpoint", endpoint]
        nodes = [
            subprocess.Popen(
                [sys.executable, "-m", "distft.cli", *args, *placement, "--node-rank", str(node)],
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                env=run_env,
            )
            for node, log in enumerate(logs)
        ]
        try:
            _wait(nodes, timeout, grace)
        finally:
            for p in nodes:
                if p.poll() is None:
                    _kill_tree(p.pid)
                    p.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
    return [(p.returncode if p.returncode >= 0 else None, out) for p, out in zip(nodes, outputs, strict=True)]


def _wait(nodes: list[subprocess.Popen], timeout: float, grace: float) -> None:
    """Until every agent has exited, `timeout` has passed, or `grace` since the first failure."""
    deadline, failed_at = time.monotonic() + timeout, None
    while any(p.poll() is None for p in nodes) and time.monotonic() < deadline:
        if failed_at is None and any(p.returncode for p in nodes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() > failed_at + grace:
            return
        time.sleep(0.2)


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
        # Tolerate it in at most one element per thousand, and by at most 1% of one step; a wrong
        # gradient moves many elements by a whole step.
        off = (a[name] - b[name]).abs() > rtol * b[name].norm()
        assert off.sum() * 1000 <= off.numel(), f"{name}: relative difference {error:.2e}"
        assert (a[name] - b[name]).abs().max() <= 1e-2 * LEARNING_RATE, f"{name}: {error:.2e}"
