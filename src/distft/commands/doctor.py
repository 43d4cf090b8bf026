"""`distft doctor`'s flags. The command is `distft.doctor`'s."""

from __future__ import annotations

import argparse

from distft.config import ParallelConfig

DEFAULT_SIZES = "1KiB,64KiB,1MiB,16MiB,128MiB"  # --sizes: all-reduce buffers from latency- to bandwidth-bound


def add_doctor_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="before a long multi-node job: check every rank answers, name a missing or slow one, and "
        "measure all-reduce bandwidth",
        description="Launch --nproc processes on this node (run the same command on every node, with its "
        "--node-rank), run the health check of `distft train` (a roll call with a timeout, then a timed "
        "all-reduce) and time all-reduces of each --sizes, then print a table. See docs/multi-node.md.",
    )
    p.add_argument("--nproc", type=int, default=1, help="processes per node, as for distft train")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (run the same command on each)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1")
    p.add_argument(
        "--rdzv-endpoint", default=ParallelConfig.rdzv_endpoint, help="HOST:PORT of node 0 (multi-node)"
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="as train.device")
    p.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help=f"all-reduce buffer sizes, comma-separated (default {DEFAULT_SIZES})",
    )
    p.add_argument(
        "--iterations", type=int, default=0, help="timed all-reduces per size (default: ~512 MiB each, 3-20)"
    )
    p.add_argument(
        "--timeout-s",
        type=int,
        default=ParallelConfig.health_timeout_s,
        help="seconds for every rank to answer the roll call",
    )
    p.add_argument(
        "--slow-s",
        type=float,
        default=ParallelConfig.health_slow_s,
        help="a rank joining this many seconds after the first is slow",
    )
