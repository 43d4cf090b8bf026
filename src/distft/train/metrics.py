"""What a run records: `metrics.jsonl` (one record per logged step) and `ranks.json` (per rank).

A step's record holds its loss, learning rate, gradient norm, throughput and peak memory, plus
what `distft.train.measure` adds (collective bytes, saved activations, a pipeline's timeline),
`skipped` for a step whose update was skipped, and `eval_loss` where the run evaluated.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import torch
import torch.distributed as dist

from distft.data import Example
from distft.distributed import DistEnv
from distft.io.files import atomic_write_text
from distft.tensors import local_bytes
from distft.train.setup import Run


class MetricsWriter:
    """`metrics.jsonl`: one JSON object per logged step, flushed as it is written."""

    def __init__(self, path: Path, append: bool = False):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a" if append else "w", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop metrics lines past `last_step` (written after the checkpoint a run resumes from)."""
    if not path.is_file():
        return

    def keep(line: str) -> bool:
        try:
            return json.loads(line)["step"] <= last_step
        except (json.JSONDecodeError, KeyError):
            return False  # a line cut short by the crash

    lines = [line for line in path.read_text().splitlines() if keep(line)]
    atomic_write_text(path, "".join(line + "\n" for line in lines))


def peak_memory_bytes(env: DistEnv) -> int:
    if env.device.type == "cuda":
        return torch.cuda.max_memory_allocated(env.device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def step_record(
    run: Run, step: int, examples: list[Example], loss: float, grad_norm: float, step_time: float
) -> dict:
    """The figures every step records, in `metrics.jsonl`'s order."""
    tokens = sum(len(e.input_ids) for e in examples)
    return {
        "step": step,
        "loss": loss,
        "lr": run.scheduler.get_last_lr()[0],
        "grad_norm": grad_norm,
        "tokens": tokens,
        "tokens_per_s": tokens / step_time,
        "step_time_s": step_time,
        "peak_mem_bytes": peak_memory_bytes(run.env),
    }


def rank_summary(run: Run, saved_activation_bytes: int) -> dict:
    """This rank's end-of-run figures for `ranks.json`: peak memory and bytes by kind."""
    return {
        "rank": run.env.rank,
        "peak_mem_bytes": peak_memory_bytes(run.env),
        "saved_activation_bytes": saved_activation_bytes,
        "param_bytes": run.param_bytes,
        "grad_bytes": run.grad_bytes,
        "optimizer_bytes": local_bytes(
            v for state in run.optimizer.state.values() for v in state.values() if torch.is_tensor(v)
        ),
    }


def gather_rank_summaries(env: DistEnv, summary: dict) -> list[dict]:
    """Every rank's end-of-run figures (peak memory, activation bytes), on every rank."""
    if not env.distributed:
        return [summary]
    gathered: list[dict | None] = [None] * env.world_size
    dist.all_gather_object(gathered, summary)
    return gathered  # type: ignore[return-value]
