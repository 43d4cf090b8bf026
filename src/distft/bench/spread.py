"""Repeated measurements: their spread, and rankings that claim no more than the spreads allow.

One implementation for `distft bench --strategies ... --repeats N` and `distft bench --study`:

- a configuration run N times (interleaved with the others, so that a slow spell of a shared
  machine falls on all of them) gives N figures, one per run (the median over its measured
  steps); `spread` reduces them to the median, min-max and interquartile range;
- two configurations are ordered only when their min-max ranges do not overlap (`compare`); when
  they overlap, the honest verdict is "no winner", whatever the medians say;
- `rank` orders several configurations by median and marks which neighbours are separated and
  which are not, so a report can say "ddp ~ zero2 > fsdp" instead of crowning the first.

Min-max is deliberately strict: with 3 repeats it is the only spread that means anything, and on a
shared machine a single slow run is the common failure, which min-max shows rather than hides.
"""

from __future__ import annotations

import itertools
import statistics


def spread(values: list[float]) -> dict[str, float]:
    """Median, min, max and quartiles of measured values (one value: all equal)."""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "q1": q1, "q3": q3}


def compare(a: dict[str, float], b: dict[str, float]) -> str:
    """Where range `a` lies against range `b`: "above", "below" or "overlap" (min-max, inclusive)."""
    if a["min"] > b["max"]:
        return "above"
    if a["max"] < b["min"]:
        return "below"
    return "overlap"


def rank(spreads: dict[str, dict[str, float]], higher_is_better: bool = True) -> dict:
    """Order configurations by median, keeping apart only what the ranges separate.

    Returns `order` (best median first), `leaders` (the best and every configuration whose range
    overlaps the best's: none of them can be called the winner over another), `winner` (the one
    leader, or None when several share the lead) and `chain`, e.g. "ddp ~ zero2 > fsdp": `>` where
    the next range lies wholly on the worse side of the previous one, `~` where they overlap."""
    order = sorted(spreads, key=lambda k: spreads[k]["median"], reverse=higher_is_better)
    if not order:
        return {"order": [], "leaders": [], "winner": None, "chain": ""}
    better = "above" if higher_is_better else "below"
    best = spreads[order[0]]
    leaders = [k for k in order if k == order[0] or compare(spreads[k], best) == "overlap"]
    chain = order[0]
    for prev, name in itertools.pairwise(order):
        chain += (" > " if compare(spreads[prev], spreads[name]) == better else " ~ ") + name
    return {
        "order": order,
        "leaders": leaders,
        "winner": leaders[0] if len(leaders) == 1 else None,
        "chain": chain,
    }


def ranking_sentence(spreads: dict[str, dict[str, float]], what: str, higher_is_better: bool = True) -> str:
    """One sentence for a report: a winner only when its range clears every other's."""
    r = rank(spreads, higher_is_better)
    if len(r["order"]) < 2:
        return ""
    if r["winner"]:
        verdict = f"**{r['winner']}** has the best {what}: its min-max range clears every other's."
    else:
        names = ", ".join(r["leaders"][:-1]) + f" and {r['leaders'][-1]}"
        verdict = f"No winner on {what}: the min-max ranges of {names} overlap."
    return f"{verdict} Ranking by median (`>`: ranges apart, `~`: ranges overlap): {r['chain']}."
