"""The launch checks, pure: ranks that differ in device or software (`distft.health.facts`), bfloat16
on a GPU without it (`distft.health.cuda`), a rank without its GPU (`distft.distributed`). CUDA is
patched, so they run on any CPU; tests/test_health.py runs the gathered comparison for real."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from distft import signals
from distft.config import load_config
from distft.distributed import DistEnv, agree_on_devices, check_local_gpu, init_distributed
from distft.errors import ConfigError, HealthError
from distft.health.facts import device_facts, differences, mixed_facts, rank_ranges
from distft.health.stragglers import StragglerWindow
from distft.train.boundary import StepBoundary
from distft.train.preflight import preflight
from tests.helpers import distft, free_port, spawn

SHORT = [  # the micro model, 3 steps of one sequence per rank
    "--model", "micro", "train.max_steps=3", "train.global_batch_size=2", "train.micro_batch_size=1",
    "train.eval_every=0", "train.eval_batches=1", "data.max_length=256", "data.max_rows=16",
    "output.save_base=false",
]  # fmt: skip

# ---- same hardware and software ------------------------------------------------------------------

A100 = {"device": "cuda NVIDIA A100-SXM4-80GB", "memory_gib": 79.1, "capability": "8.0", "cuda": "12.8"}
SOFTWARE = {
    "torch": "2.13.0",
    "transformers": "5.23.0",
    "peft": "0.21.0",
    "python": "3.12.3",
    "distft": "0.1.0",
}


def table(**odd: dict) -> list[dict]:
    """Four ranks on hosts a, a, b, b, alike but for `odd` (rank number as "r3" -> facts replaced)."""
    facts = [{"host": "ab"[r // 2], **A100, **SOFTWARE} for r in range(4)]
    for key, changes in odd.items():
        facts[int(key[1:])].update(changes)
    return facts


def test_alike_ranks_pass():
    assert mixed_facts(table()) is None
    assert (
        differences([{**f, "host": f"h{i}"} for i, f in enumerate(table())]) == []
    )  # hosts differ by nature


def test_the_odd_rank_is_named_with_its_host_and_the_majority():
    message = mixed_facts(table(r3={"torch": "2.12.0"}))
    assert message.startswith(
        "The ranks do not run on the same hardware and software: rank 3 (host b) has torch 2.12.0, "
        "ranks 0-2 torch 2.13.0."
    ), message


def test_every_difference_is_one_clause_of_one_paragraph():
    facts = table(
        r1={"device": "cuda Tesla V100-SXM2-32GB", "memory_gib": 31.7, "capability": "7.0"},
        r2={"transformers": "5.22.0"},
        r3={"transformers": "5.22.0"},
    )
    clauses = differences(facts)
    assert clauses == [
        "rank 1 (host a) has device cuda Tesla V100-SXM2-32GB, ranks 0, 2, 3 device cuda NVIDIA A100-SXM4-80GB",
        "rank 1 (host a) has device memory (GiB) 31.7, ranks 0, 2, 3 device memory (GiB) 79.1",
        "rank 1 (host a) has compute capability 7.0, ranks 0, 2, 3 compute capability 8.0",
        # two against two: rank 0's value is the majority
        "ranks 2, 3 (host b) have transformers 5.22.0, ranks 0, 1 transformers 5.23.0",
    ]
    assert "\n" not in mixed_facts(facts)


def test_a_rank_without_a_gpu_is_a_difference():
    facts = table()
    facts[2] = {"host": "b", "device": "cpu", **SOFTWARE}  # no memory, capability or CUDA runtime
    assert (
        differences(facts)[0]
        == "rank 2 (host b) has device cpu, ranks 0, 1, 3 device cuda NVIDIA A100-SXM4-80GB"
    )


def test_rank_ranges():
    assert rank_ranges([3]) == "rank 3"
    assert rank_ranges([5, 0, 1, 2, 7, 8]) == "ranks 0-2, 5, 7, 8"


def test_this_ranks_facts():
    facts = device_facts(torch.device("cpu"))
    assert facts["device"] == "cpu" and facts["torch"] == torch.__version__
    assert set(facts) == {"host", "device", "torch", "transformers", "peft", "python", "distft"}


# ---- bfloat16 on a GPU without it ----------------------------------------------------------------


def patched_cuda(*gpus: tuple[str, tuple[int, int]]):
    """torch.cuda as a node with these GPUs (name, compute capability) shows them."""
    return mock.patch.multiple(
        torch.cuda,
        is_available=lambda: True,
        device_count=lambda: len(gpus),
        get_device_name=lambda i=0: gpus[i][0],
        get_device_capability=lambda i=0: gpus[i][1],
    )


@pytest.mark.parametrize(
    ("overrides", "asks"),
    [
        ([], "model.autocast=true asks for bfloat16"),  # the default
        (["model.dtype=bfloat16", "model.autocast=false"], "model.dtype=bfloat16 asks for bfloat16"),
        (["model.dtype=bfloat16"], "model.dtype=bfloat16 and model.autocast=true ask for bfloat16"),
    ],
)
def test_bf16_on_an_older_gpu_is_refused_before_launch(overrides, asks):
    cfg = load_config(None, ["train.device=cuda", "parallel.nproc=2", *overrides])
    with patched_cuda(("Tesla T4", (7, 5)), ("Tesla T4", (7, 5))), pytest.raises(ConfigError) as err:
        preflight(cfg)
    assert str(err.value).startswith(asks), err.value
    assert (
        "GPU 0 (Tesla T4, compute capability 7.5), GPU 1 (Tesla T4, compute capability 7.5) are older"
        in str(err.value)
    )
    assert "Set model.dtype=float32 and model.autocast=false" in str(err.value)


def test_fp32_on_an_older_gpu_and_bf16_on_a_newer_one_pass_the_check(monkeypatch):
    monkeypatch.setattr(
        "distft.train.preflight.check_resume", mock.Mock(side_effect=RuntimeError("past the check"))
    )
    for gpu, overrides in [
        (("Tesla V100", (7, 0)), ["model.autocast=false"]),
        (("NVIDIA A100", (8, 0)), ["model.dtype=bfloat16"]),
    ]:
        cfg = load_config(None, ["train.device=cuda", *overrides])
        with patched_cuda(gpu), pytest.raises(RuntimeError, match="past the check"):
            preflight(cfg)


# ---- a rank without its GPU ----------------------------------------------------------------------


def test_a_local_rank_past_the_visible_gpus_is_named(monkeypatch):
    check_local_gpu(1, 2, None)  # GPU 1 of 2: fine
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ConfigError) as err:
        check_local_gpu(3, 2, "0,1")
    assert "Rank 3 (host " in str(err.value)
    assert "local rank 3) takes GPU 3, but this process sees 2 GPU(s) (CUDA_VISIBLE_DEVICES='0,1')" in str(
        err.value
    )


def test_init_distributed_names_the_missing_gpu_before_touching_it(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with (
        patched_cuda(("NVIDIA H100", (9, 0)), ("NVIDIA H100", (9, 0))),
        mock.patch.object(torch.cuda, "set_device", side_effect=AssertionError("reached set_device")),
        pytest.raises(ConfigError, match="takes GPU 2, but this process sees 2 GPU"),
    ):
        init_distributed("auto")


def in_threads(rank: Callable[[int], None], world_size: int, timeout_s: float = 60) -> None:
    """`rank(r)` for every r, each in a thread (ranks meeting on one store). What a thread raises
    is raised here, the lowest rank's first: a thread's own exception would only be printed, and
    the test would pass."""
    raised: dict[int, BaseException] = {}

    def run(r: int) -> None:
        try:
            rank(r)
        except BaseException as err:  # every failure, assertions included, goes back to the test
            raised[r] = err

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), f"a rank still runs after {timeout_s} s"
    if raised:
        first = min(raised)
        raise AssertionError(f"rank {first} of {world_size} raised {raised[first]!r}") from raised[first]


def test_ranks_without_a_gpu_among_ranks_with_one_are_named_before_the_group():
    """Three ranks meet on one store (threads): rank 1 found no GPU. Every rank raises the same error."""
    store, errors = dist.HashStore(), {}

    def rank(r: int) -> None:
        with pytest.raises(HealthError) as err:
            agree_on_devices(store, r, 3, on_cuda=r != 1, timeout_s=10)
        errors[r] = str(err.value)

    in_threads(rank, 3)
    assert sorted(errors) == [0, 1, 2] and len(set(errors.values())) == 1, errors
    assert errors[0].startswith("rank 1 (host ")
    assert (
        "found no GPU and would run on the CPU (gloo), while the other 2 of 3 ranks run on GPUs (NCCL)"
        in errors[0]
    )


def test_ranks_that_agree_pass_the_device_roll_call():
    store = dist.HashStore()
    in_threads(lambda r: agree_on_devices(store, r, 2, on_cuda=False, timeout_s=10), 2)


# ---- stragglers -----------------------------------------------------------------------------------


def test_a_rank_arriving_late_is_named_once_a_window_completes():
    window = StragglerWindow(4, 1.5, names=[f"rank {r} (host h{r})" for r in range(4)])
    times = {
        2: [0.1, 0.11, 0.1, 0.3],
        3: [0.1, 0.1, 0.1, 0.35],
        4: [0.12, 0.1, 0.1, 0.3],
        5: [0.1, 0.1, 0.1, 0.25],  # rank 3: median 0.3 s
    }
    assert [window.add(step, t) for step, t in list(times.items())[:3]] == [[], [], []]
    (found,) = window.add(5, times[5])  # rank 3's median 0.3 s against the others' 0.1 s
    assert (found.rank, found.first_step, found.last_step) == (3, 2, 5)
    assert found.ratio == pytest.approx(3.0)
    assert window.message(found).startswith(
        "rank 3 (host h3) is a straggler: over steps 2-5 it took 3.0x the other ranks' median to reach each "
        "step (0.3 s against 0.1 s)"
    )
    # One slow step in a window is no straggler (the median); two windows in a row are one span.
    assert window.add(6, [0.1, 0.9, 0.1, 0.1]) == [] and window.rows == [(6, [0.1, 0.9, 0.1, 0.1])]
    for step in (7, 8, 9):
        window.add(step, [0.1, 0.1, 0.1, 0.1])
    for step in (10, 11, 12, 13):
        assert [f.rank for f in window.add(step, [0.1, 0.1, 0.1, 0.2])] == ([3] if step == 13 else [])
    for step in (14, 15, 16, 17):
        window.add(step, [0.1, 0.1, 0.1, 0.4])
    assert window.found == {3: {"ratio": 4.0, "steps": [[2, 5], [10, 17]]}}


def test_two_ranks_the_slow_one_alone_is_named():
    """Against the other ranks' median, not everyone's: with two ranks the mean would halve the ratio."""
    window = StragglerWindow(2, 1.5)
    window.add(1, [0.05, 0.35])
    (found,) = window.add(2, [0.05, 0.35])
    assert found.rank == 1 and found.ratio == pytest.approx(7.0)
    assert window.message(found).startswith("rank 1 is a straggler")


def test_the_monitor_is_off_for_one_process_and_window_zero_and_one_process_reads_its_own_signal():
    cpu = torch.device("cpu")
    alone = StepBoundary.start(DistEnv(0, 1, 0, cpu, None), 8, 1.5)
    assert alone.window is None and not alone.collective and alone.of(0) is None
    assert alone.cross(1) == ([], 0)  # no collective, no signal
    with signals.handling(), signals.deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        assert alone.cross(2) == ([], signal.SIGTERM)
    off = StepBoundary.start(DistEnv(0, 2, 0, cpu, "gloo"), 0, 1.5)
    assert off.window is None and off.collective  # the stop signal still crosses


def _cross_two_boundaries(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    boundary = StepBoundary.start(DistEnv(rank, 2, rank, torch.device("cpu"), "gloo"), 1, 1.5)
    with signals.handling(), signals.deferred():
        assert boundary.cross(1) == ([], 0)  # no arrival time before the first boundary
        if rank == 1:
            time.sleep(0.3)  # rank 1 arrives late at step 2, and alone received SIGTERM
            os.kill(os.getpid(), signal.SIGTERM)
        findings, signum = boundary.cross(2)
    assert signum == signal.SIGTERM  # on both ranks: both stop after step 1
    assert [f.rank for f in findings] == [1] and findings[0].seconds >= 0.3
    dist.destroy_process_group()


def test_one_all_reduce_between_steps_carries_every_arrival_and_any_rank_s_signal():
    spawn(_cross_two_boundaries, (free_port(),), nprocs=2, timeout=120)


def test_a_slow_rank_is_named_in_the_log_and_ranks_json_and_mixed_ranks_allowed(tmp_path):
    """Rank 1 sleeps 0.5 s before each step. Both ranks spend the step itself in lockstep, so rank 1
    arrives 0.5 s after rank 0 however loaded the machine is, but the ratio shrinks as steps slow
    down (a step takes 0.1-4 s on 2 shared cores): a ratio of 1.05 keeps the test off the load."""
    out = tmp_path / "run"
    proc = distft(
        "train", "--strategy", "ddp", "--nproc", "2", "--allow-mixed", *SHORT, "train.straggler_window=2",
        "train.straggler_ratio=1.05", "--out", str(out),
        env={"DISTFT_FAULT_SLOW_RANK_S": "0.5", "DISTFT_FAULT_DEVICE_FACTS": '{"peft": "0.20.0"}'},
    )  # fmt: skip
    host = socket.gethostname()
    assert f"rank 1 (host {host}) has peft 0.20.0, rank 0 peft" in proc.stdout, proc.stdout
    assert "Going on: parallel.allow_mixed=true." in proc.stdout
    # Step 1 has no arrival time (no step before it): steps 2-3 are the first window.
    assert (
        f"warning: rank 1 (node 0, host {host}, local rank 1) is a straggler: over steps 2-3" in proc.stdout
    )
    ranks = json.loads((out / "ranks.json").read_text())
    assert ranks[0]["straggler"] is None
    assert ranks[1]["straggler"]["steps"] == [[2, 3]] and ranks[1]["straggler"]["ratio"] > 1.05, ranks[1]


# ---- a global batch larger than the data -----------------------------------------------------------


def test_a_global_batch_beyond_the_rows_is_said_before_launch(tmp_path, capsys):
    """Valid (every step repeats rows), so a warning, and the mean labelled positions the run's
    prediction counts with come back from the data read before launch."""
    said = {}
    for batch in (64, 4):
        cfg = load_config(None, ["model.name=micro", "data.max_rows=18", f"train.global_batch_size={batch}"])
        cfg.output.dir = str(tmp_path / f"run-{batch}")
        labels = preflight(cfg)
        said[batch] = capsys.readouterr().err
        assert labels and 0 < labels <= cfg.data.max_length
    assert "train.global_batch_size=64 is more than the 18 training rows" in said[64]
    assert "is more than the" not in said[4]


# ---- one answer for every rank: rank 0 decides (a resume's checksums), the others receive -------


def _rank_zero_decides(rank: int, port: int) -> None:
    from pathlib import Path

    from distft.distributed import decided_by_rank_zero
    from distft.errors import DamagedFileError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    env = DistEnv(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"), backend="gloo")

    def read_everything():
        assert rank == 0, "only rank 0 reads and checksums"
        return Path("run/checkpoints/step-000004"), ["step-000006 (its manifest does not match)"]

    got = decided_by_rank_zero(env, read_everything)  # rank 1 would fail the assertion inside
    assert got == (Path("run/checkpoints/step-000004"), ["step-000006 (its manifest does not match)"])

    def refuse():
        raise DamagedFileError("every checkpoint is damaged")

    try:
        decided_by_rank_zero(env, refuse)
    except DamagedFileError as err:  # the same class and words on every rank
        assert str(err) == "every checkpoint is damaged"
    else:
        raise AssertionError("the refusal reached no rank")
    dist.destroy_process_group()


def test_rank_zero_decides_and_every_rank_takes_its_answer_or_refusal():
    from tests.helpers import spawn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn(_rank_zero_decides, (port,), nprocs=2, timeout=120)
