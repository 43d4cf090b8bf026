"""The benchmark's plots (PNG, matplotlib): throughput, memory by component, bytes per collective,
loss curves, and the pipeline sweep's idle fractions and Gantt charts (measured vs ideal)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from distft.measure.pipeline import simulate

KINDS = ["all_reduce", "all_gather", "reduce_scatter", "send", "recv", "broadcast", "all_to_all"]


def mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def plot_throughput(results: list[dict], path: Path) -> None:
    names = [r["strategy"] for r in results]
    med = [r["tokens_per_s"]["median"] for r in results]
    low = [m - r["tokens_per_s"]["min"] for m, r in zip(med, results, strict=True)]
    high = [r["tokens_per_s"]["max"] - m for m, r in zip(med, results, strict=True)]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, med, yerr=[low, high], capsize=4, color="#4C72B0")
    ax.set_ylabel("tokens / s (median, min-max)")
    ax.set_title("Throughput per strategy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


COMPONENTS = [  # (measured key in ranks.json, plan key, label)
    ("param_bytes", "params", "parameters"),
    ("grad_bytes", "grads", "gradients"),
    ("optimizer_bytes", "optimizer", "optimizer state"),
    ("saved_activation_bytes", "activations", "activations"),
]
COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52"]


def measured_components(rank: dict) -> dict[str, float]:
    """Bytes by component on one rank; param_bytes is a dict by storage kind (dense, NF4 parts)."""
    out = {}
    for key, _, label in COMPONENTS:
        value = rank.get(key, 0)
        out[label] = float(sum(value.values()) if isinstance(value, dict) else value)
    return out


def plot_memory(results: list[dict], path: Path, plan: dict | None = None) -> None:
    """Per rank, measured bytes stacked by component; beside each strategy the plan's prediction."""
    plan = (plan or {}).get("strategies", {})
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * sum(len(r["ranks"]) + 1 for r in results)), 4))
    labels, x, bars, hatched = [], 0, [], []
    for r in results:
        for rank in r["ranks"]:
            bars.append((x, measured_components(rank), False))
            labels.append((x, f"{r['strategy']}\nr{rank['rank']}"))
            x += 1
        predicted = plan.get(r["strategy"], {})
        if "params" in predicted:
            bars.append((x, {label: float(predicted[key]) for _, key, label in COMPONENTS}, True))
            labels.append((x, f"{r['strategy']}\nplan"))
            hatched.append(x)
            x += 1
        x += 0.5
    for pos, parts, is_plan in bars:
        bottom = 0.0
        for (_, _, label), color in zip(COMPONENTS, COLORS, strict=True):
            value = parts[label] / 2**20
            ax.bar(pos, value, bottom=bottom, color=color, hatch="//" if is_plan else None,
                   alpha=0.55 if is_plan else 1.0, edgecolor="white", width=0.8)  # fmt: skip
            bottom += value
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="grey", hatch="//"))
    ax.legend(handles, [label for _, _, label in COMPONENTS] + ["distft plan's prediction"], fontsize=7)
    ax.set_xticks([p for p, _ in labels], [t for _, t in labels], fontsize=7)
    ax.set_ylabel("MiB per rank")
    ax.set_title("Memory per rank by component: measured (solid) and the plan's prediction (hatched)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_comm(results: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["strategy"] for r in results]
    bottom = [0.0] * len(results)
    for kind in KINDS:
        values = [r["comm_bytes"].get(kind, 0) / 2**20 for r in results]
        if any(values):
            ax.bar(names, values, bottom=bottom, label=kind)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("MiB per optimizer step (rank 0)")
    ax.set_title("Bytes moved per step, by collective")
    if any(bottom):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_losses(results: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for r in results:
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["strategy"], alpha=0.8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title("Loss curves (they should lie on top of each other)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


SCHEDULE_COLORS = {"gpipe": "#4C72B0", "1f1b": "#DD8452", "interleaved-1f1b": "#55A868",
                   "zero-bubble": "#C44E52", "zbv": "#8172B3"}  # fmt: skip
KIND_COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def plot_pp_idle(sweep: list[dict], path: Path) -> None:
    """Measured idle fraction against micro-batches, one line per schedule, theory dashed."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for schedule in dict.fromkeys(s["schedule"] for s in sweep):
        runs = sorted((s for s in sweep if s["schedule"] == schedule), key=lambda s: s["microbatches"])
        m = [s["microbatches"] for s in runs]
        color = SCHEDULE_COLORS.get(schedule)
        ax.plot(m, [s["idle_fraction"] for s in runs], "o-", color=color, label=f"{schedule} measured")
        ax.plot(
            m,
            [s["idle_fraction_theory"] for s in runs],
            "x--",
            color=color,
            alpha=0.7,
            label=f"{schedule} theory",
        )
    ax.set_xlabel("micro-batches per step (m)")
    ax.set_ylabel("idle fraction (mean over ranks)")
    ax.set_ylim(0, 1)
    ax.set_title("Pipeline bubble: measured (solid) vs equal-stage theory (dashed)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ideal_timeline(timeline: dict) -> list[list[dict]]:
    """The measured order of passes on each rank, replayed with equal stage times and free messages
    (`distft.measure.pipeline.simulate`): F = 1 unit, a full backward 2, a split one B 1 + W 1 (a W
    alone, with no B to send, 2). The order is what torch ran, so this is the schedule's ideal."""
    rows = [sorted(r["events"], key=lambda e: e["start"]) for r in timeline["ranks"]]
    actions = [[(e["kind"], e["stage"], e["microbatch"]) for e in row] for row in rows]
    present = {a for row in actions for a in row}
    split = any(kind == "W" for kind, _, _ in present)

    def duration(action: tuple[str, int, int]) -> float:
        kind, stage, mb = action
        if kind == "F":
            return 1.0
        if kind == "B":
            return 1.0 if split else 2.0
        return 1.0 if ("B", stage, mb) in present else 2.0

    times = simulate(actions, duration)
    return [
        [{**e, "start": start, "end": end} for e, (start, end) in zip(row, done, strict=False)]
        for row, done in zip(rows, times, strict=True)
    ]


def _gantt(ax, rows: list[list[dict]], title: str, unit: str) -> None:
    for r, events in enumerate(rows):
        for e in events:
            ax.barh(r, e["end"] - e["start"], left=e["start"], color=KIND_COLORS.get(e["kind"], "grey"),
                    edgecolor="white", linewidth=0.5, alpha=0.6 + 0.4 * (e["stage"] == min(x["stage"] for x in events)))  # fmt: skip
            label = e["kind"] + str(e["microbatch"])
            ax.text((e["start"] + e["end"]) / 2, r, label if e["stage"] == min(x["stage"] for x in events) else label.lower(),
                    ha="center", va="center", fontsize=5)  # fmt: skip
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=9)


def plot_pp_gantt(timeline: dict, path: Path) -> None:
    """The last step's passes per rank as measured, beside the schedule's ideal (equal stage times)."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 1.2 + 1.1 * len(timeline["ranks"]) * 2))
    measured = [
        [{**e, "start": e["start"] * 1e3, "end": e["end"] * 1e3} for e in r["events"]]
        for r in timeline["ranks"]
    ]
    head = f"{timeline['schedule']} (p={timeline['p']}, m={timeline['m']}, V={timeline['V']})"
    _gantt(
        top, measured, f"{head}: measured, idle {timeline['idle_fraction']:.0%}", "ms from the step's start"
    )
    _gantt(bottom, ideal_timeline(timeline), f"{head}: ideal, idle {timeline['idle_fraction_theory']:.0%} "
           "(torch's order, equal stage times)", "units (forward = 1)")  # fmt: skip
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in KIND_COLORS.values()]
    top.legend(handles, ["F forward", "B backward", "W weight grad"], fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
