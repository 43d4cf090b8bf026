"""The pipeline's timeline: when each stage computed, when it waited, and how that compares to theory.

`PipelineTimeline(strategy, out_dir)` times every F (forward), B (backward; input gradient only
under zero-bubble and zbv) and W (weight gradient) pass this rank's stages compute, by wrapping the
`PipelineStage` methods that run them, and each training `schedule.step()`; the time between passes
is waiting (recv, the schedule's own bookkeeping). `report(step)`, called on every rank after the
step, gathers every rank's timeline (one `all_gather_object` over the world) and returns the
step's `idle_fraction` (mean over ranks of 1 - busy / step time) and `idle_fraction_theory` (equal
stage times, `Layout.theoretical_idle_fraction`); on the last step rank 0 also writes
`DIR/pipeline_timeline.json` with the events, the imbalance floor (1 - mean busy / max busy: no
schedule beats its busiest rank) and the schedule replayed with measured pass times and free
messages (`replay`). The file's format and how to read it: docs/pp.md.

Beside the measured figures, the modelled ones of the cut the run uses (`ModelledCut`, from the
stage cost model `distft.parallel.pipeline.cost`) and of the even cut: each stage's share of the
modelled cost, the stage imbalance (slowest / mean stage) and the idle fraction of the schedule
replayed with modelled pass times. Every step records `stage_imbalance` (slowest / mean of the
stages' measured busy time) beside `stage_imbalance_modelled`, and `idle_fraction_modelled`
beside `idle_fraction` and `idle_fraction_theory`. A cut that `distft train --calibrate RUN` set
from another run's timeline (`distft.parallel.pipeline.calibrate`) is recorded as `calibrated_from`.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from distft.io.files import atomic_write_text
from distft.parallel.pipeline import PipelineParallel
from distft.parallel.pipeline.cost import CostModel, even_cut, imbalance, pass_times
from distft.parallel.pipeline.layout import SPLIT_BACKWARD, Layout
from distft.parallel.pipeline.stages import Action

PASSES = (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W"))


class PipelineTimeline:
    """Per-step F/B/W intervals of this rank's stages, gathered and reported after each step."""

    def __init__(self, strategy: PipelineParallel, out_dir: Path | str):
        self.strategy = strategy
        self.path = Path(out_dir) / "pipeline_timeline.json"
        self.events: list[dict] = []  # this step's passes (perf_counter seconds)
        self.step_start = self.step_time = 0.0
        self._recording = False  # inside a training step (evaluation does not use the schedule)
        self.modelled = modelled_cuts(strategy.layout, strategy.costs, strategy.actions())
        self.modelled["pp_split"] = strategy.cfg.parallel.pp_split
        self.modelled["calibrated_from"] = strategy.cfg.calibration  # `distft train --calibrate RUN`
        for stage in strategy.stages:
            self._time_passes(stage)
        self._time_steps(strategy.schedule)

    def _time_passes(self, stage: PipelineStage) -> None:
        """Record start and end of every F, B and W this stage computes (the waits lie between)."""
        for method, kind in PASSES:
            original = getattr(stage, method)

            def timed(chunk: int, *args, _original=original, _kind=kind, _stage=stage.stage_index, **kwargs):
                if not self._recording:
                    return _original(chunk, *args, **kwargs)
                start = time.perf_counter()
                out = _original(chunk, *args, **kwargs)
                self.events.append(
                    {
                        "stage": _stage,
                        "microbatch": chunk,
                        "kind": _kind,
                        "start": start,
                        "end": time.perf_counter(),
                    }
                )
                return out

            setattr(stage, method, timed)

    def _time_steps(self, schedule) -> None:
        """A step's time is its `schedule.step()` on this rank; each step starts a new timeline."""
        original = schedule.step

        def step(*args, **kwargs):
            self.events = []
            self._recording = True
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._recording = False
                self.step_start, self.step_time = start, time.perf_counter() - start

        schedule.step = step

    def rank_timeline(self) -> dict:
        """This rank's last step: its stages, busy time, idle fraction and passes (from the step's start)."""
        busy = sum(e["end"] - e["start"] for e in self.events)
        return {
            "rank": self.strategy.env.rank,
            "stages": self.strategy.stage_ids,
            "step_time_s": self.step_time,
            "busy_s": busy,
            "idle_fraction": 1 - busy / self.step_time,
            "events": [
                {**e, "start": e["start"] - self.step_start, "end": e["end"] - self.step_start}
                for e in self.events
            ],
        }

    def report(self, step: int) -> dict:
        """Gather every rank's timeline; idle fraction measured and theoretical; the file on the last step."""
        strategy = self.strategy
        env, lay = strategy.env, strategy.layout
        ranks: list[dict | None] = [None] * env.world_size
        dist.all_gather_object(ranks, self.rank_timeline())
        measured = statistics.mean(r["idle_fraction"] for r in ranks)
        theory = lay.theoretical_idle_fraction()
        stages = stage_busy(ranks, lay.num_stages)
        cut = self.modelled["cut"]
        figures = {
            "idle_fraction": measured,
            "idle_fraction_theory": theory,
            "idle_fraction_modelled": cut["idle_fraction"],
            "stage_imbalance": imbalance(stages) if min(stages) > 0 else None,
            "stage_imbalance_modelled": cut["stage_imbalance"],
        }
        if env.is_main and step == strategy.cfg.train.max_steps:
            busy = [r["busy_s"] for r in ranks]
            timeline = {
                "schedule": lay.schedule,
                "p": lay.ranks,
                "m": lay.microbatches,
                "V": lay.stages_per_rank,
                "step": step,
                "step_time_s": max(r["step_time_s"] for r in ranks),
                **figures,
                # No schedule beats the busiest rank: the others idle at least this much on average.
                "idle_fraction_imbalance_floor": 1 - statistics.mean(busy) / max(busy),
                "idle_fraction_replayed": replay(strategy.actions(), mean_durations(ranks)),
                "layers_per_stage": list(lay.layers_per_stage),
                "stage_busy_s": stages,
                "modelled": self.modelled,
                "ranks": ranks,
            }
            atomic_write_text(self.path, json.dumps(timeline, indent=1))
        return figures


def simulate(
    actions: list[list[Action]], duration: Callable[[Action], float]
) -> list[list[tuple[float, float]]]:
    """Each rank's passes, in the order given, started as soon as the rank is free and the pass's
    inputs exist, with messages instant: the (start, end) of each pass, or of as many as complete.

    Dependencies: F(s, i) after F(s-1, i); B(s, i) after F(s, i) and B(s+1, i); W(s, i) after B(s, i),
    each only where that pass is in `actions`.
    """
    last = max(s for row in actions for _, s, _ in row)
    present = {a for row in actions for a in row}  # a measured timeline may lack a pass (no B on stage 0)
    done: dict[Action, float] = {}
    free, out = [0.0] * len(actions), [[] for _ in actions]
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(actions):
            while len(out[r]) < len(row):
                kind, s, i = action = row[len(out[r])]
                deps = {"F": [("F", s - 1, i)] if s else [], "W": [("B", s, i)]}.get(
                    kind, [("F", s, i)] + ([("B", s + 1, i)] if s < last else [])
                )
                deps = [d for d in deps if d in present]
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                free[r] = done[action] = start + duration(action)
                out[r].append((start, free[r]))
                progress = True
    return out


def replay(actions: list[list[Action]], durations: dict[tuple[int, str], float]) -> float | None:
    """Idle fraction of `actions` (each rank's compute, in order) if every pass took its measured
    mean duration and messages were instant (`simulate`); None if the actions do not all complete.

    Against the measured idle fraction it separates what the stage times explain (the schedule's
    bubble plus unequal stages) from what they do not (waiting on messages, overhead).
    """
    rows = simulate(actions, lambda a: durations[(a[1], a[0])])
    if any(len(done) < len(row) for done, row in zip(rows, actions, strict=True)):
        return None
    end = max(row[-1][1] for row in rows if row)
    busy = [sum(durations[(s, kind)] for kind, s, _ in row) for row in actions]
    return statistics.mean(1 - b / end for b in busy)


def mean_durations(ranks: list[dict]) -> dict[tuple[int, str], float]:
    """Mean duration of each (stage, kind) pass over a timeline's events."""
    spans: dict[tuple[int, str], list[float]] = {}
    for r in ranks:
        for e in r["events"]:
            spans.setdefault((e["stage"], e["kind"]), []).append(e["end"] - e["start"])
    return {key: statistics.mean(v) for key, v in spans.items()}


def stage_busy(ranks: list[dict], num_stages: int) -> list[float]:
    """Each stage's measured busy time in a step (all its passes), averaged over the pipeline
    replicas that hold it (ddp+pp, fsdp+pp: every rank of a stage's mesh column)."""
    busy, holders = [0.0] * num_stages, [0] * num_stages
    for r in ranks:
        for s in r["stages"]:
            holders[s] += 1
        for e in r["events"]:
            busy[e["stage"]] += e["end"] - e["start"]
    return [b / h for b, h in zip(busy, holders, strict=True)]


def modelled_cut(lay: Layout, costs: CostModel, actions: list[list[Action]]) -> dict:
    """What the cost model says of `lay`'s cut: each stage's share of the modelled cost, the stage
    imbalance (slowest / mean stage) and the idle fraction of `actions` replayed with modelled pass
    times (`cost.pass_times`: forward 1, backward 2; B and W as their FLOPs split)."""
    cut = lay.layers_per_stage
    stage = costs.stage_costs(cut)
    total = sum(stage)
    passes = pass_times(costs.stage_passes(cut), lay.schedule in SPLIT_BACKWARD)
    return {
        "layers_per_stage": list(cut),
        "stage_cost_share": [c / total for c in stage],
        "stage_imbalance": imbalance(stage),
        "idle_fraction": replay(actions, passes),
    }


def modelled_cuts(lay: Layout, costs: CostModel, actions: list[list[Action]]) -> dict:
    """`modelled_cut` of the cut the run uses and of the even one (the same schedule: its action
    list does not depend on the cut), and the cost model's figures."""
    even = replace(lay, layers_per_stage=even_cut(costs.num_layers, lay.num_stages))
    return {
        "cut": modelled_cut(lay, costs, actions),
        "even": modelled_cut(even, costs, actions),
        "cost_model": costs.describe(),
    }


def cut_lines(modelled: dict) -> list[str]:
    """The header's lines: the cut, each stage's share of the modelled cost, the imbalance and the
    modelled idle fraction, for the cut used and the even one."""

    def describe(c: dict) -> str:
        layers = "/".join(str(n) for n in c["layers_per_stage"])
        shares = "/".join(f"{x:.0%}" for x in c["stage_cost_share"])
        idle = f"{c['idle_fraction']:.0%}" if c["idle_fraction"] is not None else "n/a"
        return (
            f"layers {layers}, modelled cost {shares}, slowest/mean stage {c['stage_imbalance']:.2f}, "
            f"modelled idle {idle}"
        )

    model = modelled["cost_model"]
    source = modelled.get("calibrated_from")
    calibrated = f", calibrated from {source['run']}" if source else ""
    return [
        f"pipeline cut (parallel.pp_split={modelled['pp_split']}{calibrated}): {describe(modelled['cut'])}",
        f"  even cut: {describe(modelled['even'])} (cost model: {model['tokens_per_sequence']} tokens "
        f"per row, {model['label_tokens_per_sequence']:.0f} labelled; distft.parallel.pipeline.cost)",
    ]
