"""`distft.launch`: the torchrun arguments of a layout, and which way the ranks start (the forked
CPU way runs in every multi-process test; the exec'd CUDA way is checked here by its command)."""

import subprocess
import sys

from distft import launch
from distft.config import ParallelConfig


def test_one_node_is_standalone():
    args = launch.torchrun_args(ParallelConfig(nproc=4))
    assert args == ["--nproc-per-node=4", "--max-restarts=0", "--standalone"]


def test_several_nodes_meet_at_node_zero():
    p = ParallelConfig(nproc=8, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500", max_restarts=2)
    assert launch.torchrun_args(p) == [
        "--nproc-per-node=8", "--max-restarts=2", "--nnodes=2", "--node-rank=1",
        "--master-addr=10.0.0.1", "--master-port=29500",
    ]  # fmt: skip


def test_cuda_ranks_are_execd_through_distft_launch(monkeypatch):
    calls = []

    def forked(*args, **kwargs):
        raise AssertionError("a process that touched CUDA must not fork its ranks")

    monkeypatch.setattr(subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    monkeypatch.setattr(launch, "main", forked)
    assert launch.launch_ranks(ParallelConfig(nproc=2), ["train", "--config", "c.toml"], fork=False) == 0
    assert calls == [
        [sys.executable, "-m", "distft.launch", "--nproc-per-node=2", "--max-restarts=0", "--standalone",
         "-m", "distft.cli", "train", "--config", "c.toml"],
    ]  # fmt: skip
