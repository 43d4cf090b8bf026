"""The pre-flight checks (`distft.health`): the environment before launch, a roll call and a timed
all-reduce that name a missing or slow rank, and `distft doctor`'s bandwidth table.

The environment checks are pure functions of a dict, tested here without a network. The rank
checks run for real: `distft doctor` under torchrun (no model is built, so each run costs only the
launch), with a missing or late rank injected by the DISTFT_FAULT_HEALTH_* variables of
`tests.faults`. `distft train` runs the same check; tests/parallel/test_multi_node.py sees its line
in every multi-node run.
"""

from __future__ import annotations

import re
import socket
import subprocess

import pytest
import torch

from distft.cli import main
from distft.health import HealthReport, RankPlace, failure_advice, network_warnings
from distft.health.network import endpoint_warning
from tests.helpers import agents, run_cli

HOST = socket.gethostname()

# ---- the environment (pure) -----------------------------------------------------------------------

NICS = ["docker0", "eth0", "ib0", "lo"]  # docker0 and lo: NCCL skips them by default

ENVIRONMENTS = [
    # (id, environ, backend, nproc, nnodes, interfaces, phrases expected: one warning each)
    ("clean single node", {}, "nccl", 2, 1, NICS, []),
    ("unset, two candidates", {}, "nccl", 2, 2, NICS,
     ["NCCL_SOCKET_IFNAME is unset and this node has 2 candidate network interfaces (eth0, ib0)"]),
    ("unset, one candidate", {}, "nccl", 2, 2, ["docker0", "eth0", "lo"], []),
    ("prefix", {"NCCL_SOCKET_IFNAME": "eth"}, "nccl", 2, 2, NICS, []),
    ("exact", {"NCCL_SOCKET_IFNAME": "=ib0"}, "nccl", 2, 2, NICS, []),
    ("exclusion", {"NCCL_SOCKET_IFNAME": "^docker,lo"}, "nccl", 2, 2, NICS, []),
    ("names no interface", {"NCCL_SOCKET_IFNAME": "eth1"}, "nccl", 2, 2, NICS,
     ["NCCL_SOCKET_IFNAME=eth1 selects none of this node's interfaces (docker0, eth0, ib0, lo)"]),
    ("exact name absent", {"NCCL_SOCKET_IFNAME": "=eth"}, "nccl", 2, 2, NICS, ["selects none"]),
    ("InfiniBand off", {"NCCL_SOCKET_IFNAME": "ib", "NCCL_IB_DISABLE": "1"}, "nccl", 2, 2, NICS,
     ["NCCL_IB_DISABLE=1: InfiniBand/RoCE is off"]),
    ("InfiniBand off, one node", {"NCCL_IB_DISABLE": "1"}, "nccl", 2, 1, NICS, []),
    ("P2P off", {"NCCL_P2P_DISABLE": "1"}, "nccl", 2, 1, NICS, ["NCCL_P2P_DISABLE=1: GPUs of one node"]),
    ("fewer GPUs than ranks", {"CUDA_VISIBLE_DEVICES": "0,1"}, "nccl", 4, 1, NICS,
     ["CUDA_VISIBLE_DEVICES='0,1' shows 2 GPU(s) but --nproc is 4", "local ranks 2..3 have none"]),
    ("idle GPUs", {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "nccl", 2, 1, NICS, ["2 of them stay idle"]),
    ("gloo: its own variable", {"NCCL_IB_DISABLE": "1"}, "gloo", 2, 2, NICS,
     ["GLOO_SOCKET_IFNAME is unset and this node has 2 candidate"]),
    ("gloo: set", {"GLOO_SOCKET_IFNAME": "eth0", "CUDA_VISIBLE_DEVICES": ""}, "gloo", 2, 2, NICS, []),
]  # fmt: skip


@pytest.mark.parametrize(
    ("environ", "backend", "nproc", "nnodes", "interfaces", "expected"),
    [case[1:] for case in ENVIRONMENTS],
    ids=[case[0] for case in ENVIRONMENTS],
)
def test_network_warnings(environ, backend, nproc, nnodes, interfaces, expected):
    warnings = network_warnings(environ, backend, nproc, nnodes, interfaces)
    assert len(warnings) == (1 if expected else 0), warnings
    assert all(phrase in warnings[0] for phrase in expected), warnings


@pytest.mark.parametrize(
    ("endpoint", "nnodes", "warned"),
    [
        ("8.8.8.8:29500", 2, True),  # a public address: anyone reaching it can join
        ("[2606:4700::1111]:29500", 2, True),
        ("10.0.0.1:29500", 2, False),  # private networks
        ("192.168.1.5:29500", 2, False),
        ("127.0.0.1:29500", 2, False),
        ("8.8.8.8:29500", 1, False),  # one node: nothing crosses the network
        ("node0.cluster:29500", 2, False),  # a host name is not resolved before launch
    ],
)
def test_a_public_rendezvous_endpoint_is_named(endpoint, nnodes, warned):
    warning = endpoint_warning(endpoint, nnodes)
    assert (warning is not None) == warned
    assert not warned or ("no authentication" in warning and "docs/security.md" in warning)


def test_failure_advice_suggests_nccl_debug_until_it_is_on():
    assert "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET" in failure_advice({}, "nccl")
    assert failure_advice({"NCCL_DEBUG": "info"}, "nccl") == ""
    assert failure_advice({}, "gloo") == ""


def test_lateness_compares_no_clocks():
    """Everyone leaves an all-reduce once the last rank joined: the latest waited least."""
    places = [RankPlace(r, r // 2, f"host{r // 2}", r % 2) for r in range(4)]
    report = HealthReport(places, roll_call_s=0.01, waits_s=[8.002, 8.003, 0.001, 8.0], slow_s=5.0)
    assert [round(late, 3) for late in report.late_s] == [0.001, 0.0, 8.002, 0.003]
    assert report.slow == [places[2]]
    assert report.slow_messages()[0].startswith(
        "rank 2 (node 1, host host1, local rank 0) joined the health check's all-reduce 8.0 s after the first rank"
    )
    assert "a 4 KiB all-reduce took 1.0 ms once all had joined; the last to join, rank 2" in report.summary()


# ---- the ranks, for real -------------------------------------------------------------------------


def doctor(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`distft doctor ARGS` with fault variables set; a failure is expected, so not raised."""
    return run_cli("doctor", *args, env=env)


def test_doctor_passes_two_healthy_nodes_and_reports_bandwidth():
    (code0, node0), (code1, _) = agents(
        "doctor", "--nproc", "1", "--sizes", "4KiB,1MiB", nnodes=2, timeout=300
    )
    assert (code0, code1) == (0, 0), node0[-3000:]
    assert f"health check: 2 ranks on 2 nodes (node 0 on {HOST}, node 1 on {HOST})" in node0
    assert re.search(rf"│ 1\s+│ 1\s+│ {HOST}\s+│ 0\s+│ [0-9.]+\s+│ [0-9.]+\s+│ ok", node0), (
        node0
    )  # rank 1: node 1
    assert "all-reduce, 2 ranks, gloo on cpu" in node0
    for size in ("4 KiB", "1 MiB"):  # size, iterations, time ms, algbw, busbw: every figure positive
        row = re.search(rf"│ {size}\s+│ (\d+)\s+│ ([0-9.]+)\s+│ ([0-9.e+-]+)\s+│ ([0-9.e+-]+)\s+│", node0)
        assert row and all(float(v) > 0 for v in row.groups()), node0[-2000:]


def test_doctor_names_a_rank_that_never_joins():
    # Rank 1 sleeps through the roll call (120 s; torchrun ends it once rank 0 has failed).
    proc = doctor(
        "--nproc", "2", "--sizes", "4KiB", "--timeout-s", "3",
        env={"DISTFT_FAULT_HEALTH_MISS": "1", "DISTFT_FAULT_HANG_S": "120"},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (
        f"distft doctor: error: The pre-flight health check: rank 1 (node 0, host {HOST}, local rank 1) did not "
        "join within 3 s (1 of 2 ranks did)." in proc.stderr
    ), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_doctor_names_a_slow_rank_and_one_unlike_the_others():
    faults = {"DISTFT_FAULT_HEALTH_LATE_S": "5", "DISTFT_FAULT_DEVICE_FACTS": '{"torch": "2.12.0"}'}
    proc = doctor("--nproc", "2", "--sizes", "4KiB", "--slow-s", "2", env=faults)
    assert proc.returncode == 1, proc.stderr[-3000:]
    # Two ranks, one each way: rank 0's is the majority. Every rank gathered the same table; one prints.
    mixed = (
        f"The ranks do not run on the same hardware and software: rank 1 (host {HOST}) has torch 2.12.0, "
        f"rank 0 torch {torch.__version__}."
    )
    assert proc.stderr.count(mixed) == 1 and "--allow-mixed (parallel.allow_mixed=true)" in proc.stderr, (
        proc.stderr
    )
    late = re.search(
        rf"rank 1 \(node 0, host {HOST}, local rank 1\) joined the health check's all-reduce ([0-9.]+) s after "
        r"the first rank \(the limit is 2 s\)",
        proc.stderr,
    )
    assert late and 4.5 <= float(late.group(1)) <= 6, proc.stderr[-3000:]
    assert re.search(r"│ 1\s+│ 0\s+│ \S+\s+│ 1\s+│ [0-9.]+\s+│ [0-9.]+\s+│ slow", proc.stdout), proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--sizes", "lots"], "--sizes 'lots': give sizes with a unit"),
        (["--nproc", "0"], "`parallel.nproc` must be positive, got 0"),
        (["--nnodes", "2", "--node-rank", "2"], "`parallel.node_rank` is 2 but there are 2 nodes"),
        (["--timeout-s", "0"], "`parallel.health_timeout_s` must be positive, got 0"),
    ],
)
def test_doctor_refuses_bad_arguments(args, expected, capsys):
    assert main(["doctor", *args]) == 2
    assert expected in capsys.readouterr().err
