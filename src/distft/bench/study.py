"""`distft bench --study NAME`: a correct run beside its misconfigurations, repeated, with spreads.

A study is a list of configurations (a label, a strategy, `section.key=value` switches). Every
configuration runs `--repeats` times, interleaved (repeat 1 of each, then repeat 2 of each, ...),
so slow spells of a shared machine fall on every configuration instead of on one. Per
configuration and repeat the figure is the median step time over the measured steps; across
repeats the report gives the median, min-max and the interquartile range. A configuration is
called slower or faster than the correct run only when their min-max ranges do not overlap
(`distft.bench.spread`, shared with `distft bench --strategies ... --repeats N`).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path

from distft.bench.harness import BenchSettings, StrategyResult, environment, loss_agreement, run_strategy
from distft.bench.spread import compare, spread
from distft.commands.bench import STUDIES
from distft.errors import ConfigError


def steady_figures(run_dir: Path, warmup: int) -> dict:
    """Per measured step of one run: bytes and calls (the last step: DDP's steady state after its
    bucket rebuild) and the overlap figures (median over the measured steps)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = records[warmup:] or records
    last = measured[-1]
    out = {
        "bytes": sum(last.get("comm_bytes", {}).values()),
        "calls": sum(last.get("comm_calls", {}).values()),
    }
    for key in ("comm_s", "comm_exposed_s", "overlap_fraction"):
        values = [r[key] for r in measured if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def run_study(settings: BenchSettings, study: str, out: Path) -> dict:
    repeats = settings.repeats
    if study not in STUDIES:
        raise ConfigError(f"Unknown study {study!r}; available: {', '.join(STUDIES)}.")
    if repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {repeats}.")
    configs = STUDIES[study]
    runs: dict[str, list[dict]] = {label: [] for label in configs}
    results: dict[str, StrategyResult] = {}
    failures: dict[str, str] = {}
    for repeat in range(1, repeats + 1):  # interleaved: every configuration once per round
        for i, (label, (strategy, switches)) in enumerate(configs.items()):
            if label in failures:
                continue
            print(f"bench: {study} repeat {repeat}/{repeats}: {label} ...", flush=True)
            run_dir = out / "runs" / f"c{i}-r{repeat}"
            try:
                r = run_strategy(settings, strategy, run_dir, switches)
            except RuntimeError as err:
                failures[label] = str(err)
                print(f"bench: {err}", flush=True)
                continue
            results.setdefault(label, r)
            runs[label].append(
                {
                    "repeat": repeat,
                    "step_time_s": r.step_time_s["median"],
                    **steady_figures(run_dir, settings.warmup),
                }
            )
    rows = summarize(configs, runs, settings.nproc)
    named = [StrategyResult(**{**asdict(r), "strategy": label}) for label, r in results.items()]
    return {
        "study": study,
        "repeats": repeats,
        "settings": asdict(settings),
        "environment": environment(),
        "rows": rows,
        "runs": runs,
        "failures": failures,
        "loss_agreement": loss_agreement(named) if named else {},
        # the correct run's (the second configuration), as resolved by `distft train`
        "config": next((c.read_text() for c in [out / "runs" / "c1-r1" / "config.toml"] if c.exists()), ""),
    }


def summarize(configs: dict, runs: dict[str, list[dict]], nproc: int) -> list[dict]:
    """One row per configuration: spreads over repeats, speedup over single, verdict vs the correct run."""
    rows = []
    for label, (strategy, switches) in configs.items():
        done = runs[label]
        if not done:
            continue
        row = {
            "label": label,
            "strategy": strategy,
            "switches": list(switches),
            "ranks": 1 if strategy == "single" else nproc,
        }
        row["step_time_s"] = spread([d["step_time_s"] for d in done])
        for key in ("bytes", "calls"):
            row[key] = statistics.median(d[key] for d in done)
        for key in ("comm_s", "comm_exposed_s", "overlap_fraction"):
            values = [d[key] for d in done if d[key] is not None]
            row[key] = spread(values) if values else None
        rows.append(row)
    single = next((r for r in rows if r["strategy"] == "single"), None)
    correct = next((r for r in rows if r["strategy"] != "single"), None)
    for row in rows:
        t = row["step_time_s"]
        if single:  # same global batch: speedup = ratio of step times; range from the extremes
            s = single["step_time_s"]
            row["speedup"] = {
                "median": s["median"] / t["median"],
                "min": s["min"] / t["max"],
                "max": s["max"] / t["min"],
            }
        if correct and row is not correct and row["strategy"] != "single":
            c = correct["step_time_s"]
            verdict = {"above": "slower", "below": "faster", "overlap": "spreads overlap"}[compare(t, c)]
            row["vs_correct"] = {"ratio": t["median"] / c["median"], "verdict": verdict}
    return rows
