"""Pipeline timelines shaped like `pipeline_timeline.json`, for the report's and the plots' tests:
nothing runs."""

from __future__ import annotations


def timeline_1f1b(p: int = 2, m: int = 2) -> dict:
    """A measured-looking 1F1B timeline: torch's order, forward 10 ms, backward 20 ms, a gap each."""
    ranks = []
    for r in range(p):
        warm = min(m, p - r)
        order = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            order += [("B", i), ("F", warm + i)]
        order += [("B", i) for i in range(m - warm, m)]
        t, events = 0.001 * r, []
        for kind, i in order:
            d = 0.01 if kind == "F" else 0.02
            events.append({"stage": r, "microbatch": i, "kind": kind, "start": t, "end": t + d})
            t += d + 0.002
        ranks.append({"rank": r, "stages": [r], "step_time_s": t, "busy_s": 0.03 * m, "idle_fraction": 0.3,
                      "events": events})  # fmt: skip
    return {"schedule": "1f1b", "p": p, "m": m, "V": 1, "step": 3, "step_time_s": 0.2, "idle_fraction": 0.3,
            "idle_fraction_theory": (p - 1) / (m + p - 1), "idle_fraction_imbalance_floor": 0.0,
            "idle_fraction_replayed": 0.3, "ranks": ranks}  # fmt: skip


def sweep_run(
    schedule: str,
    m: int,
    split: str,
    layers: list[int],
    idle: tuple[float, float],  # measured, modelled
    step: tuple[float, float, float],  # median, min, max over the measured steps
    imbalance: tuple[float, float] = (1.5, 1.4),  # measured, modelled
) -> dict:
    """One cell of results.json's `pp_sweep` as `distft.bench.pp_sweep.sweep_entry` writes it."""
    timeline = {**timeline_1f1b(2, m), "schedule": schedule, "layers_per_stage": layers,
                "idle_fraction_modelled": idle[1], "modelled": {"pp_split": split}}  # fmt: skip
    return {"schedule": schedule, "microbatches": m, "split": split, "layers_per_stage": layers,
            "step_time_s": dict(zip(("median", "min", "max"), step, strict=True)), "losses": [1.0],
            "idle_fraction": idle[0], "idle_fraction_theory": 1 / (m + 1), "idle_fraction_modelled": idle[1],
            "stage_imbalance": imbalance[0], "stage_imbalance_modelled": imbalance[1],
            "idle_fraction_replayed": idle[0] - 0.02, "idle_fraction_imbalance_floor": idle[0] - 0.05,
            "timeline": timeline}  # fmt: skip
