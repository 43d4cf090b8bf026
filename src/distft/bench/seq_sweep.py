"""`distft bench --seq-sweep`: how long a sequence each strategy and activation lever trains on.

For every strategy and every lever (a `model.activation_checkpointing` level, optionally with
`model.mlp_tiles`), `distft train` runs at doubling sequence lengths, `data.max_length` = start,
2 x start, ... up to `--seq-max` (default: the positions the model's rotary embeddings reach).
A series stops early at the first run that dies out of memory (CUDA's allocator says so in the
run's log; the sweep goes on with the next series) or fails otherwise. On the CPU nothing limits
memory but the host, so a series runs to `--seq-max`, and the report says that is why it stopped.

Every row must fill the length, or a "longer" run would train on the same short rows: the rows are
the bundled meetings joined end to end (`gpu.long_rows`, as `--gpu` does), long enough for
`--seq-max`, and each run cuts them to its length (`data.max_length`, the middle of the transcript
dropped, the summary kept). With one sequence per micro-batch, packing puts one document in each
row, so a step trains exactly global batch x length tokens; the sweep checks that on the data
before it launches anything, and the report checks it again on every run's measured tokens.

Per run: tokens/s, MFU (on a GPU the peak table knows), peak memory (CUDA's
`max_memory_allocated`; the CPU has no tensor-only figure), and the activations autograd kept for
the first micro-batch on the fullest rank (`ranks.json`) beside what `distft plan` predicts for
the same strategy, lever, length and labelled positions (`predict.plan_memory`).
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from distft.bench.gpu import long_rows
from distft.bench.harness import BenchSettings, environment, run_strategy
from distft.bench.plain import distft_rows
from distft.bench.predict import plan_memory
from distft.config import load_config
from distft.config.choices import CHECKPOINTING
from distft.data import IGNORE
from distft.errors import ConfigError
from distft.io.files import atomic_write_text
from distft.layout import SPECS
from distft.model.build import architecture
from distft.model.positions import max_positions
from distft.parallel import check_config, check_model

# The chat prompt, a bundled meeting's summary (46-74 tokens) and the 32 transcript tokens a cut
# prompt keeps at least take ~150 tokens; from 256 up most of every row is transcript.
MIN_SEQ_LEN = 256
# How torch says an allocation failed: CUDA's allocator (torch.OutOfMemoryError: CUDA out of memory.
# Tried to allocate ...), and the CPU's when the host refuses one.
OUT_OF_MEMORY = re.compile(r"OutOfMemoryError|CUDA out of memory|DefaultCPUAllocator: can't allocate memory")
OFFLOAD_ON_CPU = "offload skipped: on the CPU the layer inputs already live in host memory, so it is full"


@dataclass
class SeqSweepSettings:
    strategies: list[str]
    levers: list[str]  # `parse_lever`: a checkpointing level, optionally +tilesK
    nproc: int = 2
    model: str = "tiny"
    seq_start: int = 1024
    seq_max: int = 0  # 0: the model's positions (`model_positions`)
    steps: int = 3
    warmup: int = 1
    global_batch_size: int = 1
    micro_batch_size: int = 1
    seed: int = 0
    overrides: list[str] = field(default_factory=list)

    def bench_settings(self, length: int, lever: str, data: Path | None = None) -> BenchSettings:
        """The harness's settings for one run: this length, this lever, the sweep's rows."""
        source = [f"data.source={data}"] if data else []
        # Neither evaluation nor counting collectives (a hook on every op on the CPU) is what the
        # sweep measures: both off, unless the overrides say otherwise.
        quiet = ["train.eval_batches=0", "train.measure_comm=off"]
        return BenchSettings(
            strategies=self.strategies, nproc=self.nproc, model=self.model, steps=self.steps,
            warmup=self.warmup, global_batch_size=self.global_batch_size, micro_batch_size=self.micro_batch_size,
            seq_len=length, seed=self.seed, overrides=[*quiet, *self.overrides, *source, *lever_overrides(lever)],
        )  # fmt: skip

    def argv(self, out: Path) -> list[str]:
        """`distft` arguments that run this sweep again, every setting spelled out."""
        return [
            "bench", "--seq-sweep", "--strategies", ",".join(self.strategies), "--seq-levers", ",".join(self.levers),
            "--nproc", str(self.nproc), "--model", self.model, "--seq-start", str(self.seq_start),
            "--seq-max", str(self.seq_max), "--steps", str(self.steps), "--warmup", str(self.warmup),
            "--global-batch", str(self.global_batch_size), "--micro-batch", str(self.micro_batch_size),
            "--out", str(out), *self.overrides,
        ]  # fmt: skip


def parse_lever(text: str) -> tuple[str, int]:
    """`full` -> ("full", 0); `none+tiles8` -> ("none", 8): a checkpointing level and MLP tiles."""
    level, _, tiles = text.partition("+")
    m = re.fullmatch(r"tiles(\d+)", tiles) if tiles else None
    if level not in CHECKPOINTING or (tiles and (not m or int(m.group(1)) < 2)):
        raise ConfigError(
            f"--seq-levers: {text!r} is not a lever; give a model.activation_checkpointing level "
            f"({', '.join(CHECKPOINTING)}), optionally with +tilesK for model.mlp_tiles=K (K >= 2), e.g. full+tiles8."
        )
    return level, int(m.group(1)) if m else 0


def lever_overrides(lever: str) -> list[str]:
    level, tiles = parse_lever(lever)
    return [f"model.activation_checkpointing={level}", f"model.mlp_tiles={tiles}"]


def doubling(start: int, stop: int) -> list[int]:
    """start, 2 x start, 4 x start, ... while at most `stop`."""
    lengths = [start]
    while lengths[-1] * 2 <= stop:
        lengths.append(lengths[-1] * 2)
    return lengths


def model_positions(model: str, overrides: list[str]) -> int:
    """The longest sequence the model's rotary embeddings reach (model.rope_scaling included)."""
    return max_positions(architecture(load_config(None, [f"model.name={model}", *overrides]).model))


def resolve(settings: SeqSweepSettings, cuda: bool) -> list[str]:
    """Check every option and every strategy x lever before anything runs (one-line ConfigErrors);
    fill in `seq_max`; drop `offload` on the CPU. Returns the notes the report carries."""
    unknown = [s for s in settings.strategies if s not in SPECS]
    if unknown:
        raise ConfigError(f"Unknown strategies {', '.join(unknown)}; available: {', '.join(SPECS)}.")
    for lever in settings.levers:
        parse_lever(lever)
    if settings.seq_start < MIN_SEQ_LEN:
        raise ConfigError(
            f"--seq-start must be at least {MIN_SEQ_LEN}, got {settings.seq_start}: a row holds the chat prompt, "
            "a summary and some transcript."
        )
    positions = model_positions(settings.model, settings.overrides)  # 0: the config does not say
    if not settings.seq_max and not positions:
        raise ConfigError(
            f"--seq-max: {settings.model} does not say how many positions it reaches; give one."
        )
    settings.seq_max = settings.seq_max or positions
    if settings.seq_start > settings.seq_max:
        raise ConfigError(f"--seq-start {settings.seq_start} is above --seq-max {settings.seq_max}.")
    if positions and settings.seq_max > positions:
        raise ConfigError(
            f"--seq-max {settings.seq_max} is past the {positions:,} positions {settings.model} reaches; "
            "lower it, or stretch them with model.rope_scaling=yarn model.rope_factor=F."
        )
    if settings.warmup < 0 or settings.steps < 1:
        raise ConfigError("--steps must be at least 1 and --warmup cannot be negative.")
    notes = []
    if not cuda and any(parse_lever(lever)[0] == "offload" for lever in settings.levers):
        settings.levers = [lever for lever in settings.levers if parse_lever(lever)[0] != "offload"]
        notes.append(OFFLOAD_ON_CPU)
    if not settings.levers or not settings.strategies:
        raise ConfigError("--seq-sweep: no strategy or no lever left to run.")
    for strategy in settings.strategies:  # what `distft train` would refuse, refused now
        for lever in settings.levers:
            run = settings.bench_settings(settings.seq_start, lever)
            cfg = load_config(None, [
                f"model.name={run.model}", f"parallel.strategy={strategy}",
                f"parallel.nproc={1 if strategy == 'single' else run.nproc}", f"data.max_length={run.seq_len}",
                f"train.global_batch_size={run.global_batch_size}", f"train.micro_batch_size={run.micro_batch_size}",
                *run.overrides,
            ])  # fmt: skip
            check_config(cfg)
            check_model(cfg, architecture(cfg.model))
    return notes


def sweep_rows(settings: SeqSweepSettings, path: Path) -> float:
    """Write rows long enough for `seq_max`, as many as the runs read (a split off for validation
    needs a few more), and check each fills `seq_start` exactly; the median labelled positions
    per row (the summary's), which the planner's prediction needs."""
    needed = settings.global_batch_size * (settings.warmup + settings.steps)
    long_rows(settings.seq_max, path, limit=max(10, needed + needed // 9 + 2))
    examples, _ = distft_rows(
        settings.model,
        [*settings.overrides, f"data.source={path}", f"data.max_length={settings.seq_start}"],
        0,
    )
    short = [len(e.input_ids) for e in examples if len(e.input_ids) != settings.seq_start]
    if short:
        raise ConfigError(
            f"--seq-sweep: {len(short)} row(s) do not fill {settings.seq_start} tokens: {short[:3]}"
        )
    return statistics.median(sum(t != IGNORE for t in e.labels) for e in examples)


def run_point(
    settings: SeqSweepSettings, strategy: str, lever: str, length: int, data: Path, out: Path, context: dict
) -> dict:
    """One `distft train` at `length`: its figures, or how it ended (out of memory, or failed).
    `context`: cuda (whether peak memory means anything), precision and labels (for the planner)."""
    point = {"strategy": strategy, "lever": lever, "length": length}
    run_dir = out / "runs" / f"{strategy}-{lever}-{length}"
    bench = settings.bench_settings(length, lever, data)
    try:
        r = run_strategy(bench, strategy, run_dir)
    except RuntimeError as err:  # the harness's one exception for a run that exited non-zero
        log = run_dir.parent / f"{run_dir.name}.log"  # every rank's output, not only the tail in `err`
        return point | {"result": ending(log.read_text() if log.exists() else str(err)), "error": str(err)}
    planned = plan_memory(bench, [strategy], context["precision"], context["labels"])[strategy]
    return point | {
        "result": "fits",
        "world_size": r.world_size,
        "tokens_per_step": r.tokens_per_step,
        "expected_tokens_per_step": settings.global_batch_size * length,
        "tokens_per_s": r.tokens_per_s["median"],
        "step_time_s": r.step_time_s["median"],
        "mfu": r.extra.get("mfu"),
        # CUDA's max_memory_allocated; on the CPU ranks.json holds the process's resident size instead.
        "peak_mem_bytes": max(rank["peak_mem_bytes"] for rank in r.ranks) if context["cuda"] else None,
        "activations_measured": max(rank["saved_activation_bytes"] for rank in r.ranks),  # the fullest rank
        "activations_predicted": planned.get("activations"),  # None where the plan cannot model it
    }


def ending(log: str) -> str:
    """How a run that exited non-zero ended, from its output: out of memory (a result: the length
    does not fit), or failed (anything else: a bug or a setting to fix)."""
    return "out of memory" if OUT_OF_MEMORY.search(log) else "failed"


def series_end(points: list[dict], seq_max: int, cuda: bool) -> str:
    """Why a strategy x lever series stopped where it did, in words for the report."""
    last = points[-1]
    if last["result"] == "out of memory":
        return f"out of memory at {last['length']:,}"
    if last["result"] == "failed":
        return f"failed at {last['length']:,}"
    where = "" if cuda else " (the CPU: nothing limits memory but the host)"
    return f"reached --seq-max {seq_max:,}{where}"


def run_seq_sweep(settings: SeqSweepSettings, out: Path) -> dict:
    """Every strategy x lever at doubling lengths until one does not fit; the figures of each run."""
    cuda = torch.cuda.is_available()
    notes = resolve(settings, cuda)
    if cuda:
        notes.append(
            "compiled blocks run outside autograd's saved-tensor hooks, so the measured activations undercount "
            "there (model.compile=false counts them all); peak memory is the figure that decides what fits"
        )
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data" / "long.jsonl"
    context = {"cuda": cuda, "precision": "mixed" if cuda else "fp32", "labels": sweep_rows(settings, data)}
    lengths = doubling(settings.seq_start, settings.seq_max)
    points, series = [], []
    for strategy in settings.strategies:
        for lever in settings.levers:
            done: list[dict] = []
            for length in lengths:
                print(f"bench --seq-sweep: {strategy}, {lever}, {length:,} tokens ...", flush=True)
                done.append(run_point(settings, strategy, lever, length, data, out, context))
                if done[-1]["result"] != "fits":
                    print(f"bench --seq-sweep: {done[-1]['result']}: {done[-1]['error']}", flush=True)
                    break
            fit = [p["length"] for p in done if p["result"] == "fits"]
            series.append({"strategy": strategy, "lever": lever, "longest_fit": max(fit, default=None),
                           "stopped": series_end(done, settings.seq_max, cuda)})  # fmt: skip
            points += done
    summary = {
        "settings": asdict(settings),
        "environment": environment(),
        "notes": notes,
        "label_tokens": context["labels"],
        "lengths": lengths,
        "points": points,
        "series": series,
        "failures": {
            f"{p['strategy']}-{p['lever']}-{p['length']}": p["error"]
            for p in points
            if p["result"] == "failed"
        },
    }
    atomic_write_text(out / "results.json", json.dumps(summary, indent=1))
    return summary
