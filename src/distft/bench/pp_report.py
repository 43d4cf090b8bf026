"""The pipeline sweep's section of report.md: per schedule, micro-batch count and split (the cut of
the layers, `parallel.pp_split`), the measured idle fraction against the cost model's for that cut
and against equal-stage theory, the stages' imbalance, two verdicts, and the Gantt charts with the
command that draws each one again.

The verdicts:
- *idle within 10 pp of modelled*: the cost model (`distft.parallel.pipeline.cost`, FLOPs only)
  explains the measured bubble when the two idle fractions differ by at most 10 percentage points.
  What it leaves out (each pass's fixed overhead, the messages) is large on a small CPU model, so
  "no" is a finding about the model, not a failed run.
- *step time vs even*: a cut other than `even` is judged against the even run of the same schedule
  and micro-batch count by their min-max ranges over the measured steps (`spread.compare`): slower
  only where even the fastest step of the one is slower than the slowest of the even run. Each
  sweep cell runs once, so that range is the only run-to-run spread there is.

Results from before the sweep had splits (no `split`, no modelled figures) render with "-" there.
"""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path

from distft.bench.harness import BenchSettings
from distft.bench.pp_sweep import run_name
from distft.bench.spread import compare

IDLE_TOLERANCE = 0.10  # the cost model explains the measured bubble to within 10 percentage points
STEP_VERDICTS = {"above": "no: slower", "below": "yes: faster", "overlap": "yes: within the spread"}


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def cut(run: dict) -> str:
    """The layers per stage the run used, e.g. 3/1 (stage 0 first)."""
    layers = run.get("layers_per_stage") or run.get("timeline", {}).get("layers_per_stage")
    return "/".join(map(str, layers)) if layers else "-"


def even_run(sweep: list[dict], run: dict) -> dict | None:
    """The even cut's run of the same schedule and micro-batch count as `run`."""
    return next(
        (s for s in sweep if s.get("split") == "even"
         and (s["schedule"], s["microbatches"]) == (run["schedule"], run["microbatches"])),
        None,
    )  # fmt: skip


def idle_verdict(run: dict) -> str:
    measured, modelled = run.get("idle_fraction"), run.get("idle_fraction_modelled")
    if measured is None or modelled is None:
        return "-"
    return "yes" if abs(measured - modelled) <= IDLE_TOLERANCE else "no"


def step_verdict(sweep: list[dict], run: dict) -> str:
    """A cut other than even against the even run: slower, faster, or within their spread."""
    if run.get("split") in (None, "even"):
        return "-"
    even = even_run(sweep, run)
    if even is None:
        return "- (no even run)"
    return STEP_VERDICTS[compare(run["step_time_s"], even["step_time_s"])]


def gantt_charts(sweep: list[dict]) -> dict[str, dict]:
    """The Gantt charts to draw, file name -> the run it shows: per schedule and split the smallest
    m (fewest bars, most readable). Runs recorded without a split keep the old name."""
    charts: dict[str, dict] = {}
    for run in sorted(sweep, key=lambda s: s["microbatches"]):
        split = run.get("split")
        charts.setdefault(f"pp_gantt_{run['schedule']}" + (f"_{split}" if split else "") + ".png", run)
    return charts


def rerun_command(settings: dict, run: dict, out: Path) -> str:
    """The `distft bench` command that runs this cell of the sweep alone, every setting spelled
    out; it draws the same Gantt chart (a `pp` run comes first: the bench needs one strategy),
    into a folder of its own under `out`, so that it leaves the whole sweep's report as it is."""
    alone = replace(
        BenchSettings(**settings),
        strategies=["pp"],
        pp_schedules=[run["schedule"]],
        pp_microbatches=[run["microbatches"]],
        pp_splits=[run["split"]],
    )
    cell = out / "cells" / run_name(run["schedule"], run["microbatches"], run["split"])
    return shlex.join(["distft", *alone.argv(cell)])


def before_after(pairs: list[tuple[dict, dict]], key: str) -> str:
    """`46% -> 40% at m = 2, ...`: per (even run, balanced run), the one's figure, then the other's."""
    return ", ".join(f"{pct(e.get(key))} -> {pct(b.get(key))} at m = {b['microbatches']}" for e, b in pairs)


def split_paragraph(sweep: list[dict]) -> list[str]:
    """Per schedule, the even cut against the balanced one: idle measured and modelled at each m."""
    lines = []
    for schedule in dict.fromkeys(s["schedule"] for s in sweep):
        pairs = [
            (even, run) for run in sweep
            if run["schedule"] == schedule and run.get("split") == "balanced"
            and (even := even_run(sweep, run)) is not None
        ]  # fmt: skip
        if not pairs:
            continue
        even_cut, balanced_cut = cut(pairs[0][0]), cut(pairs[0][1])
        same = "; the same cut: the runs differ by noise alone" if even_cut == balanced_cut != "-" else ""
        lines.append(
            f"- **{schedule}** (layers {even_cut} -> {balanced_cut}{same}): idle measured "
            f"{before_after(pairs, 'idle_fraction')}; modelled {before_after(pairs, 'idle_fraction_modelled')}."
        )
    if not lines:
        return []
    head = "Even -> balanced cut, per schedule (idle fraction measured, then modelled for each cut):"
    return [head, "", *lines, ""]


def table(sweep: list[dict]) -> list[str]:
    lines = [
        "| schedule | m | split | layers per stage | step time (s, median [min-max]) | idle measured | idle modelled "
        "| idle theory | imbalance floor | replayed | stage imbalance measured | stage imbalance modelled "
        "| idle within 10 pp of modelled | step time vs even |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sweep:
        st = s["step_time_s"]
        lines.append(
            f"| {s['schedule']} | {s['microbatches']} | {s.get('split') or '-'} | {cut(s)} "
            f"| {st['median']:.3f} [{st['min']:.3f}-{st['max']:.3f}] | {pct(s['idle_fraction'])} "
            f"| {pct(s.get('idle_fraction_modelled'))} | {pct(s['idle_fraction_theory'])} "
            f"| {pct(s['idle_fraction_imbalance_floor'])} | {pct(s['idle_fraction_replayed'])} "
            f"| {ratio(s.get('stage_imbalance'))} | {ratio(s.get('stage_imbalance_modelled'))} "
            f"| {idle_verdict(s)} | {step_verdict(sweep, s)} |"
        )
    return lines


def pipeline_section(summary: dict, out: Path) -> list[str]:
    sweep = summary.get("pp_sweep") or []
    if not sweep:
        return []
    judged = [v for v in map(idle_verdict, sweep) if v != "-"]
    command = shlex.join(["distft", *BenchSettings(**summary["settings"]).argv(out)])
    # Results from before splits were recorded: their settings cannot say which cut the runs used.
    recorded = all(s.get("split") for s in sweep)
    lines = [
        "## Pipeline schedules and cuts: idle fraction, measured vs the cost model vs theory",
        "",
        *([f"The sweep, every setting spelled out: `{command}`.", ""] if recorded else []),
        "Each row is one run of `pp` with one schedule, m micro-batches per step and one split of the layers "
        "(`parallel.pp_split`: balanced by the cost model, even by count, or given by hand). Idle fraction = "
        "1 - busy / step time per rank, mean over ranks, median over the measured steps. Modelled is the "
        "schedule replayed with the cost model's pass times for the run's cut (`distft.parallel.pipeline.cost`, "
        "FLOPs only); theory assumes equal stage times and free messages; the imbalance floor is what the "
        "measured stages force (1 - mean busy / max busy); replayed is torch's order replayed with the "
        "measured pass times. Stage imbalance = slowest / mean stage busy time (measured) or cost (modelled).",
        "",
        f"Verdicts. *Idle within 10 pp of modelled*: |measured - modelled| <= {IDLE_TOLERANCE:.0%} "
        f"({judged.count('yes')} of {len(judged)} runs). *Step time vs even* (rows of another split): its "
        "measured steps against those of the even run with the same schedule and m, by their min-max ranges "
        "(one run each, so the run-to-run spread is that of their steps): *no: slower* only where its fastest "
        "step is slower than the even run's slowest, *yes: faster* where its slowest beats the even run's "
        "fastest, *yes: within the spread* where the ranges overlap.",
        "",
        *table(sweep),
        "",
        *split_paragraph(sweep),
        "![idle fraction vs micro-batches: measured, modelled, theory, per split](pp_idle.png)",
        "",
    ]
    if recorded:
        lines += [
            "Gantt charts, per schedule and cut at its smallest m; under each, the command that runs that cell "
            "of the sweep alone (every setting spelled out) and draws the chart again, in `cells/` beside this "
            "report.",
            "",
        ]
    for name, run in gantt_charts(sweep).items():
        split = run.get("split")
        lines += [f"![{run['schedule']} timeline{f', {split} cut' if split else ''}]({name})", ""]
        if split:
            lines += ["```bash", rerun_command(summary["settings"], run, out), "```", ""]
    return lines
