"""What a run records: `metrics.jsonl` (one record per logged step) and `ranks.json` (per rank).

A step's record holds its loss, learning rate, gradient norm, throughput (tokens/s, model FLOPs
per token and MFU, `distft.measure.flops`; `mfu` is null off a known GPU), its measured time and
the planner's prediction for it (`step_time_predicted_s`: `distft plan`'s step time rescaled to
this step's FLOPs; null on a device with no bf16 peak, or without a prediction) and peak memory, plus
what `distft.train.measure` adds (collective bytes, saved activations, a pipeline's timeline),
`skipped` for a step whose update was skipped, `eval_loss` where the run evaluated, and
`early_stop` on the step after which early stopping ended the run (`distft.train.early_stopping`).
"""

from __future__ import annotations

import json
import os
import resource
import socket
import statistics
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from distft.config.choices import WITH_REFERENCE
from distft.data import IGNORE, Example
from distft.data.pairs import rows_of
from distft.distributed import DistEnv
from distft.io.files import atomic_write_text
from distft.measure.flops import StepTime
from distft.measure.step import StepMeasurements
from distft.tensors import local_bytes
from distft.text import plural
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


START_ENV = "DISTFT_START_TIME"  # the command's start, stamped by the CLI; the ranks it launches inherit it


def stamp_command_start() -> None:
    """Record when this command started, for every rank it launches: when its process started, so
    that a run's start-up includes the command's imports, as the plain loop's does (`distft bench
    --gpu` compares the two). A rank launched by a command keeps that command's stamp."""
    os.environ.setdefault(START_ENV, str(psutil.Process().create_time()))


def startup_seconds() -> float:
    """Seconds from the command's start (the CLI's stamp; else this process's start) to now."""
    stamp = os.environ.get(START_ENV)
    return time.time() - (float(stamp) if stamp else psutil.Process().create_time())


def peak_memory_bytes(env: DistEnv) -> int:
    if env.device.type == "cuda":
        return torch.cuda.max_memory_allocated(env.device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def step_record(
    run: Run, step: int, examples: list[Example], loss: float, grad_norm: float, step_time: float
) -> dict:
    """The figures every step records, in `metrics.jsonl`'s order."""
    items, examples = examples, rows_of(examples)  # a preference objective's pairs: both rows
    tokens = sum(len(e.input_ids) for e in examples)
    flops = run.flops.step(examples)  # the whole global batch, every rank together
    live = run.cfg.train.objective in WITH_REFERENCE and not run.cfg.dpo.precompute_reference
    # Forwards without backward: the reference's (adapters off), KTO's KL term (policy, reference).
    extra = [(e, int(live)) for e in examples]
    if run.cfg.train.objective == "kto":
        extra += [(c.mismatched, 1 + live) for c in items]
    flops += sum(
        n * run.flops.forward(len(e.input_ids), sum(t != IGNORE for t in e.labels)) for e, n in extra
    )
    peak = run.peak_flops * run.env.world_size if run.peak_flops else None
    return {
        "step": step,
        "loss": loss,
        "lr": run.step_lr,  # the rate the step used, not the next one's
        "grad_norm": grad_norm,
        "tokens": tokens,
        "tokens_per_s": tokens / step_time,
        "flops_per_token": flops / tokens,
        "mfu": flops / step_time / peak if peak else None,
        "step_time_s": step_time,
        "step_time_predicted_s": predicted_step_seconds(run.cfg.prediction, flops),
        "peak_mem_bytes": peak_memory_bytes(run.env),
        **compile_record(run),
        **run.statistics,  # a preference objective's rewards, margin, accuracy; an MoE's routing
    }


def predicted_step_seconds(prediction: dict | None, flops: float) -> float | None:
    """The planner's time for a step of `flops` model FLOPs (`Config.prediction`'s `step_time`,
    the parts of `StepTime`: its compute rescaled to these FLOPs), or None without one."""
    parts = (prediction or {}).get("step_time")
    return StepTime(**parts).for_flops(flops) if parts else None


def step_time_line(
    prediction: dict | None, measured: list[float], predicted: list[float | None], first_step: int = 1
) -> str:
    """The end-of-run line: predicted against measured step time, medians over the steps after
    the first this command ran (which compiles and warms up; `first_step`: a resumed run's) when
    there are several."""
    if not measured:
        return "step time: no step ran"
    start = 1 if len(measured) > 1 else 0
    first, last = first_step + start, first_step + len(measured) - 1
    which = f"median of steps {first}-{last}" if last > first else f"step {first}"
    got = f"measured {statistics.median(measured[start:]):.3g} s ({which})"
    if prediction is None:
        return f"step time: no prediction (the planner could not model this model), {got}"
    times = [t for t in predicted[start:] if t is not None]
    if not times:
        return f"step time: predicted n/a ({prediction.get('step_time_note') or 'no estimate'}), {got}"
    return f"step time: predicted {statistics.median(times):.3g} s (distft plan), {got}"


def compile_record(run: Run) -> dict:
    """This rank's attention kernel and what torch.compile built so far (`distft.model.compile`)."""
    stats = (
        run.compiled.record() if run.compiled else {"compiled_graphs": 0, "recompiles": 0, "graph_breaks": 0}
    )
    return {"attention": run.attention, **stats}


def speed_line(run: Run, record: dict) -> str:
    """The header's line after the first step: start-up time and MFU (or why there is none)."""
    mfu = f"MFU {record['mfu']:.1%}" if record["mfu"] is not None else "MFU n/a"
    compiled = run.compiled.describe() if run.compiled else f"eager (model.compile={run.cfg.model.compile})"
    compiled += f"; attention {run.attention}"
    if run.compiled_nf4:
        compiled += f", {run.compiled_nf4} NF4 projections dequantized by compiled kernels"
    return (
        f"start-up {record['startup_s']:.1f} s (command start to step {record['step']}); {mfu} ({run.peak_note}); "
        f"{record['flops_per_token'] / 1e9:.3g} GFLOP/token; {compiled}"
    )


def rank_summary(run: Run, saved_activation_bytes: int) -> dict:
    """This rank's end-of-run figures for `ranks.json`: where it ran (node, host, local rank, its
    groups of each mesh dimension), peak memory and bytes by kind."""
    return {
        "rank": run.env.rank,
        "node": run.env.node,
        "host": socket.gethostname(),
        "local_rank": run.env.local_rank,
        "mesh": run.strategy.mesh_groups(),
        "peak_mem_bytes": peak_memory_bytes(run.env),
        **compile_record(run),
        "saved_activation_bytes": saved_activation_bytes,
        "param_bytes": run.param_bytes,
        "grad_bytes": run.grad_bytes,
        "optimizer_bytes": local_bytes(
            v
            for state in run.strategy.local_optimizer(run.optimizer).state.values()
            for v in state.values()
            if torch.is_tensor(v)
        ),
        # How this rank had its examples (the token cache: hit, built; or in memory), and how many
        # it read: the batches', not the dataset's.
        "token_cache": {**(run.token_cache or {}), "examples_read": run.train_set.reads + run.val_set.reads},
    }


def prediction_record(run: Run, measure: StepMeasurements) -> dict:
    """The planner's prediction (`Config.prediction`, `distft.plan.auto`) beside what this rank
    measured: peak memory (CUDA's allocator; on the CPU no tensor-only figure exists: the process's
    resident size counts libraries and the allocator's cache), the first micro-batch's activations
    (with the activation model's bytes for that micro-batch) and the first step's collective bytes."""
    predicted = run.cfg.prediction or {}
    cuda = run.env.device.type == "cuda"
    return {
        "memory": {
            "predicted_peak_bytes": predicted.get("peak_mem_bytes"),
            "measured_peak_bytes": peak_memory_bytes(run.env) if cuda else None,
            "measured": "torch.cuda.max_memory_allocated" if cuda else "unavailable on CPU",
        },
        "activations": {  # kept for backward on this device: the planner's, and the first micro-batch's
            "predicted_saved_bytes": (predicted.get("activations") or {}).get("saved"),
            "predicted_host_bytes": (predicted.get("activations") or {}).get("host"),
            "expected_saved_bytes": measure.expected_activation_bytes,
            "measured_saved_bytes": measure.saved_activation_bytes,
        },
        "comm_bytes_per_step": {
            "predicted": predicted_comm_bytes(predicted, run),
            "counted": measure.first_comm_bytes,
        },
        "predicted_by": predicted.get("layout"),
    }


def predicted_comm_bytes(prediction: dict, run: Run) -> dict[str, int] | None:
    """The planner's bytes per kind for this rank: its pipeline rank's (stages differ), else rank 0's."""
    by_pp_rank = prediction.get("comm_bytes_by_pp_rank")
    if by_pp_rank:
        return by_pp_rank[getattr(run.strategy, "pp_rank", 0)]
    return prediction.get("comm_bytes")


def prediction_lines(ranks: list[dict]) -> list[str]:
    """The end-of-run summary of predicted against measured (the fullest rank of each)."""
    memory = [r["memory"] for r in ranks if r.get("memory")]
    if not memory or memory[0]["predicted_peak_bytes"] is None:
        return ["prediction: none (the planner could not model this model)"]
    predicted = max(m["predicted_peak_bytes"] for m in memory)
    measured = [m["measured_peak_bytes"] for m in memory if m["measured_peak_bytes"] is not None]
    got = f"measured {max(measured) / 2**30:.3g} GiB" if measured else "measured: unavailable on CPU"
    lines = [f"peak memory per process: predicted {predicted / 2**30:.3g} GiB (distft plan), {got}"]
    acts = [r["activations"] for r in ranks if (r.get("activations") or {}).get("predicted_saved_bytes")]
    if acts:
        want, got = (
            max(a["predicted_saved_bytes"] for a in acts),
            max(a["measured_saved_bytes"] for a in acts),
        )
        host = max(a["predicted_host_bytes"] or 0 for a in acts)
        # The first micro-batch's own rows and labelled positions, against its measure.
        expected = [a["expected_saved_bytes"] for a in acts if a.get("expected_saved_bytes") is not None]
        lines.append(
            f"activations kept for backward per process: predicted {want / 2**20:,.1f} MiB (rows of "
            f"data.max_length, the data's labelled positions), measured {got / 2**20:,.1f} MiB (first micro-batch"
            + (f", {max(expected) / 2**20:,.1f} MiB predicted for it)" if expected else ")")
            + (f"; {host / 2**20:,.1f} MiB predicted in host memory (offload)" if host else "")
        )
    comm = [r["comm_bytes_per_step"] for r in ranks]
    counted = [sum(c["counted"].values()) for c in comm if c["counted"] is not None]
    want = max(sum((c["predicted"] or {}).values()) for c in comm)
    if counted or want:
        got = (
            f"counted {max(counted):,} B"
            if counted
            else "not counted (one process, or train.measure_comm=off)"
        )
        lines.append(f"collectives per process, step 1: predicted {int(want):,} B, {got}")
    return lines


def compile_line(ranks: list[dict]) -> str:
    """The end-of-run line: the attention kernel, and what compiled on each rank (or that nothing did)."""
    line = f"attention {ranks[0]['attention']}; "
    if not any(r["compiled_graphs"] for r in ranks):
        line += "no graph compiled (eager)"
    else:
        line += ", ".join(
            f"rank {r['rank']}: {plural(r['compiled_graphs'], 'graph')}, {plural(r['recompiles'], 'recompile')}, "
            f"{plural(r['graph_breaks'], 'graph break')}"
            for r in ranks
        )
    fallbacks = {r["compile_fallback"] for r in ranks if r.get("compile_fallback")}
    return line + "".join(f"; compile fell back to eager: {f}" for f in sorted(fallbacks))


def gather_rank_summaries(env: DistEnv, summary: dict) -> list[dict]:
    """Every rank's end-of-run figures (peak memory, activation bytes), on every rank."""
    if not env.distributed:
        return [summary]
    gathered: list[dict | None] = [None] * env.world_size
    dist.all_gather_object(gathered, summary)
    return gathered  # type: ignore[return-value]
