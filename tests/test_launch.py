"""`distft.launch`: the torchrun arguments of a layout, and which way the ranks start (the forked
CPU way runs in every multi-process test; the exec'd CUDA way is checked here by its command)."""

import json
import os
import subprocess
import sys

import torch
from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from distft import launch
from distft.config import ParallelConfig
from distft.exits import FORKED_ENV
from tests.helpers import in_forked_process


def test_one_node_is_standalone():
    args = launch.torchrun_args(ParallelConfig(nproc=4))
    assert args == ["--nproc-per-node=4", "--max-restarts=0", "--shutdown-timeout=600", "--standalone"]


def test_several_nodes_meet_at_node_zero():
    p = ParallelConfig(nproc=8, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500", max_restarts=2)
    assert launch.torchrun_args(p) == [
        "--nproc-per-node=8", "--max-restarts=2", "--shutdown-timeout=600", "--nnodes=2", "--node-rank=1",
        "--master-addr=10.0.0.1", "--master-port=29500",
    ]  # fmt: skip


def test_one_node_skips_the_rendezvous_skew_and_several_keep_it(monkeypatch):
    """The skew is torchrun's first `_delay((low, high))`; polling the store (`_delay(seconds)`)
    still sleeps. A torch that renamed it fails here rather than silently sleeping again."""
    slept = []
    monkeypatch.setattr(dynamic_rendezvous, "_delay", slept.append)
    original = dynamic_rendezvous._delay
    with launch._without_rendezvous_skew(one_node=True):
        dynamic_rendezvous._delay((0, 0.3))
        dynamic_rendezvous._delay(1)
    assert slept == [1] and dynamic_rendezvous._delay is original
    with launch._without_rendezvous_skew(one_node=False):
        dynamic_rendezvous._delay((0, 0.3))
    assert slept == [1, (0, 0.3)]


def test_cuda_ranks_are_execd_through_distft_launch(monkeypatch):
    calls = []

    def forked(*args, **kwargs):
        raise AssertionError("a process that touched CUDA must not fork its ranks")

    class Launcher:  # the exec'd launcher, waited for (signals go on to it meanwhile)
        pid = -1

        def __init__(self, cmd):
            calls.append(cmd)

        def wait(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Launcher)
    monkeypatch.setattr(launch, "main", forked)
    assert launch.launch_ranks(ParallelConfig(nproc=2), ["train", "--config", "c.toml"], fork=False) == 0
    assert calls == [
        [sys.executable, "-m", "distft.launch", "--nproc-per-node=2", "--max-restarts=0",
         "--shutdown-timeout=600", "--standalone", "-m", "distft.cli", "train", "--config", "c.toml"],
    ]  # fmt: skip


def _launch_probes(out: str, nproc: int, one_thread_first: bool) -> tuple[int, int, dict[str, str]]:
    """The agent's process on 2 threads computes something large enough to go parallel (as the
    checks before a launch may), after `one_thread_before_forking` or not, then forks the probes."""
    os.environ.pop("OMP_NUM_THREADS", None)  # as a user's shell has it (the tests set it to 1)
    torch.set_num_threads(2)
    if one_thread_first:
        launch.one_thread_before_forking()
    torch.randperm(1_000_000, generator=torch.Generator().manual_seed(0))
    code = launch.main(
        [f"--nproc-per-node={nproc}", "--standalone", "-m", "tests.rank_probe", out], fork=True
    )
    return code, os.getpid(), dict(os.environ)


def test_forked_ranks_keep_off_the_agents_store(tmp_path):
    """Ranks forked from the agent, each with a store of its group's own: the agent's store thread
    serving a rank while the next is forked can hand that next rank a lock held forever. Each runs
    on torchrun's one thread (OMP_NUM_THREADS), which it sets itself: OpenMP read it when the agent's
    process started, and the pool of threads that process started is not in the fork (a rank going
    parallel with it would hang)."""
    code, agent, env_after = in_forked_process(_launch_probes, str(tmp_path), 2, False, timeout=120)
    assert code == 0
    ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank-*.json"))]
    assert [r["RANK"] for r in ranks] == ["0", "1"]
    for r in ranks:
        assert r["parent"] == agent  # forked, not exec'd
        assert r["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert (r[FORKED_ENV], r["TOKENIZERS_PARALLELISM"]) == ("1", "false")
        assert r["threads"] == 1
    assert FORKED_ENV not in env_after and launch.UNSHARED_STORE not in env_after  # undone after


def test_a_process_that_will_fork_computes_on_one_thread(tmp_path):
    """`one_thread_before_forking`, as `distft train` calls it before its checks: the launching
    process then never starts an OpenMP pool, so a lone rank (torchrun sets no OMP_NUM_THREADS
    for it) gets the launching process's 2 threads back and goes parallel without hanging."""
    code, _, _ = in_forked_process(_launch_probes, str(tmp_path), 1, True, timeout=120)
    assert code == 0
    assert json.loads((tmp_path / "rank-0.json").read_text())["threads"] == 2
