"""The benchmark's plots (PNG, matplotlib): throughput, memory by component, bytes per collective,
loss curves, and the pipeline sweep's idle fractions and Gantt charts (measured vs ideal)."""

from __future__ import annotations

import types
from pathlib import Path
from typing import TYPE_CHECKING

from distft.io.files import atomic_path
from distft.measure.pipeline import simulate

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

KINDS = ["all_reduce", "all_gather", "reduce_scatter", "send", "recv", "broadcast", "all_to_all"]


DPI = 100  # committed under docs/: keep each PNG small
LOG_SPAN = 100  # bytes spanning more than this factor get a log axis


def pyplot() -> types.ModuleType:
    """matplotlib's pyplot, drawing to files only, imported when a plot is drawn: imported with the
    CLI, it would add ~0.8 s to the start of every distft command."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def save(fig: Figure, path: Path) -> Figure:
    """Write the figure (legends sit outside the axes, so crop to everything drawn) and return it,
    closed, for tests to read its axes."""
    plt = pyplot()
    fig.tight_layout()
    with atomic_path(path) as tmp:  # a report never holds half a PNG
        fig.savefig(tmp, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return fig


def legend_outside(ax: Axes, *args, **kwargs) -> None:
    """A legend to the right of the axes, never over the data."""
    ax.legend(*args, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=7, **kwargs)


def plot_throughput(results: list[dict], path: Path) -> Figure:
    """Tokens/s per strategy: bar at the median, whiskers min-max (over the repeats' medians with
    --repeats, else over one run's measured steps), a dot per repeat; zero-based."""
    plt = pyplot()
    names = [r["strategy"] for r in results]
    med = [r["tokens_per_s"]["median"] for r in results]
    low = [m - r["tokens_per_s"]["min"] for m, r in zip(med, results, strict=True)]
    high = [r["tokens_per_s"]["max"] - m for m, r in zip(med, results, strict=True)]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, med, yerr=[low, high], capsize=4, color="#4C72B0")
    runs = max(len(r.get("repeats") or [None]) for r in results)
    for i, r in enumerate(results):
        dots = [x["tokens_per_s"]["median"] for x in r.get("repeats") or []]
        ax.plot([i] * len(dots), dots, "o", color="black", markersize=3)
    ax.set_ylim(bottom=0)
    over = f"min-max over {runs} runs, dots: each run" if runs > 1 else "min-max over the measured steps"
    ax.set_ylabel(f"tokens / s\n(median; {over})", fontsize=8)
    ax.set_title("Throughput per strategy")
    return save(fig, path)


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


def plot_memory(results: list[dict], path: Path, plan: dict | None = None) -> Figure:
    """Per rank, measured bytes stacked by component; beside each strategy the plan's prediction.
    Stacked bars need a linear, zero-based axis."""
    plt = pyplot()
    plan = (plan or {}).get("strategies", {})
    fig, ax = plt.subplots(figsize=(max(8, 0.8 * sum(len(r["ranks"]) + 1 for r in results)), 4))
    labels, x, bars = [], 0.0, []
    for r in results:
        for rank in r["ranks"]:
            bars.append((x, measured_components(rank), False))
            labels.append((x, f"{r['strategy']}\nr{rank['rank']}"))
            x += 1
        predicted = plan.get(r["strategy"], {})
        if "params" in predicted:
            bars.append((x, {label: float(predicted[key]) for _, key, label in COMPONENTS}, True))
            labels.append((x, f"{r['strategy']}\nplan"))
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
    legend_outside(ax, handles, [label for _, _, label in COMPONENTS] + ["distft plan's\nprediction"])
    ax.set_xticks([p for p, _ in labels], [t for _, t in labels], fontsize=7)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("MiB per rank")
    ax.set_title(
        "Memory per rank by component: measured (solid), the plan's prediction (hatched)", fontsize=10
    )
    return save(fig, path)


def plot_comm(results: list[dict], path: Path) -> Figure:
    """Bytes per optimizer step on rank 0 by collective: stacked on a zero-based axis, or side by
    side on a log axis when the strategies' totals span more than `LOG_SPAN` (DDP's LoRA gradients
    against FSDP's gathered base: three orders of magnitude)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 3.5))
    names = [r["strategy"] for r in results]
    kinds = [k for k in KINDS if any(r["comm_bytes"].get(k, 0) for r in results)]
    totals = [sum(r["comm_bytes"].values()) / 2**20 for r in results]
    positive = [t for t in totals if t > 0]
    log = bool(positive) and max(positive) / min(positive) > LOG_SPAN
    colors = dict(zip(kinds, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    bottom = [0.0] * len(results)
    for i, r in enumerate(results):
        present = [k for k in kinds if r["comm_bytes"].get(k, 0)]
        width = 0.8 / max(len(present), 1) if log else 0.8
        for j, kind in enumerate(present):
            value = r["comm_bytes"][kind] / 2**20
            if log:  # stacking means nothing on a log axis: one bar per collective, side by side
                ax.bar(i - 0.4 + width * (j + 0.5), value, width=width, color=colors[kind])
            else:
                ax.bar(i, value, bottom=bottom[i], width=width, color=colors[kind])
                bottom[i] += value
    for i, t in enumerate(totals):  # the total above each bar; "none" on the axis (log has no zero)
        where = {"xy": (i, t)} if t else {"xy": (i, 0), "xycoords": ("data", "axes fraction")}
        ax.annotate(f"{t:,.3g}" if t else "none", **where, xytext=(0, 2), textcoords="offset points",
                    ha="center", va="bottom", fontsize=7)  # fmt: skip
    ax.set_xticks(range(len(results)), names)
    if log:
        ax.set_yscale("log")
        ax.set_ylabel("MiB per step, rank 0\n(log scale; label: total)", fontsize=8)
    else:
        ax.set_ylim(bottom=0, top=max(max(totals), 1e-9) * 1.15)
        ax.set_ylabel("MiB per step, rank 0\n(label: total)", fontsize=8)
    ax.set_title("Bytes moved per optimizer step, by collective")
    if kinds:
        legend_outside(ax, [plt.Rectangle((0, 0), 1, 1, color=colors[k]) for k in kinds], kinds)
    return save(fig, path)


LINESTYLES = ["-", "--", "-.", ":"]
MARKERS = ["o", "s", "^", "v", "D", "x", "+", "*"]


def plot_losses(results: list[dict], path: Path) -> Figure:
    """Every strategy's loss per optimizer step (integer ticks). Curves that train the same thing
    coincide: each has its own line style and marker so that every one stays visible."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 3.5))
    for i, r in enumerate(results):
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["strategy"], alpha=0.8,
                linestyle=LINESTYLES[i % len(LINESTYLES)], marker=MARKERS[i % len(MARKERS)],
                markersize=9 - i, markerfacecolor="none")  # fmt: skip
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title("Loss curves (they lie on top of each other when they agree)", fontsize=10)
    legend_outside(ax)
    return save(fig, path)


SCHEDULE_COLORS = {"gpipe": "#4C72B0", "1f1b": "#DD8452", "interleaved-1f1b": "#55A868",
                   "zero-bubble": "#C44E52", "zbv": "#8172B3"}  # fmt: skip
KIND_COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


# The idle plot's lines per schedule: (sweep key, line style, label); a key a sweep lacks draws nothing.
IDLE_LINES = [
    ("idle_fraction", "o-", "measured"),
    ("idle_fraction_modelled", "s--", "cost model, this cut"),
    ("idle_fraction_theory", "x:", "theory, equal stages"),
]


def plot_pp_idle(sweep: list[dict], path: Path) -> Figure:
    """Idle fraction against micro-batches, one panel per split of the layers (balanced, even, ...):
    per schedule (one colour each) the measured idle, the cost model's for the run's cut and the
    equal-stage theory. Runs recorded before splits and modelled figures share one panel, without
    the modelled line."""
    plt = pyplot()
    splits = list(dict.fromkeys(s.get("split") for s in sweep))
    fig, axes = plt.subplots(1, len(splits), figsize=(2.4 + 3.6 * len(splits), 4), sharey=True, squeeze=False)
    for ax, split in zip(axes[0], splits, strict=True):
        of_split = [s for s in sweep if s.get("split") == split]
        for schedule in dict.fromkeys(s["schedule"] for s in of_split):
            runs = sorted((s for s in of_split if s["schedule"] == schedule), key=lambda s: s["microbatches"])
            m = [s["microbatches"] for s in runs]
            for key, style, _ in IDLE_LINES:
                values = [s.get(key) for s in runs]
                if any(v is not None for v in values):  # None (a replay that failed) leaves a gap
                    ax.plot(m, [float("nan") if v is None else v for v in values], style,
                            color=SCHEDULE_COLORS.get(schedule), alpha=1.0 if key == "idle_fraction" else 0.7)  # fmt: skip
        ax.set_xticks(sorted({s["microbatches"] for s in sweep}))  # the measured m, integers
        ax.set_xlabel("micro-batches per step (m)")
        ax.set_ylim(0, 1)
        ax.set_title(f"{split} cut" if split else "cut not recorded", fontsize=9)
    axes[0][0].set_ylabel("idle fraction (mean over ranks)")
    schedules = list(dict.fromkeys(s["schedule"] for s in sweep))
    handles = [plt.Line2D([], [], color=SCHEDULE_COLORS.get(name), linewidth=3) for name in schedules]
    handles += [
        plt.Line2D([], [], color="black", linestyle=style[1:], marker=style[0]) for _, style, _ in IDLE_LINES
    ]
    legend_outside(axes[0][-1], handles, schedules + [label for _, _, label in IDLE_LINES])
    fig.suptitle("Pipeline bubble per cut: measured vs the cost model vs equal-stage theory", fontsize=10)
    return save(fig, path)


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
    ax.set_xlim(left=0)
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=9)


def cut_label(timeline: dict) -> str:
    """The title's words for the run's cut, e.g. `, balanced cut 3/1`: the split it asked for and the
    layers per stage it got (nothing for a timeline made before cuts were recorded)."""
    layers = timeline.get("layers_per_stage")
    if not layers:
        return ""
    split = (timeline.get("modelled") or {}).get("pp_split")
    name = f"{split} cut " if isinstance(split, str) else "cut "  # a list is the layers themselves
    return f", {name}{'/'.join(map(str, layers))}"


def plot_pp_gantt(timeline: dict, path: Path) -> Figure:
    """The last step's passes per rank as measured, beside the schedule's ideal (equal stage times)."""
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 1.2 + 1.1 * len(timeline["ranks"]) * 2))
    measured = [
        [{**e, "start": e["start"] * 1e3, "end": e["end"] * 1e3} for e in r["events"]]
        for r in timeline["ranks"]
    ]
    head = f"{timeline['schedule']} (p={timeline['p']}, m={timeline['m']}, V={timeline['V']}{cut_label(timeline)})"
    modelled = timeline.get("idle_fraction_modelled")  # absent from timelines made before the cost model
    model = "" if modelled is None else f" (cost model: {modelled:.0%})"
    _gantt(
        top,
        measured,
        f"{head}: measured, idle {timeline['idle_fraction']:.0%}{model}",
        "ms from the step's start",
    )
    _gantt(bottom, ideal_timeline(timeline), f"{head}: ideal, idle {timeline['idle_fraction_theory']:.0%} "
           "(torch's order, equal stage times)", "units (forward = 1)")  # fmt: skip
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in KIND_COLORS.values()]
    legend_outside(top, handles, ["F forward", "B backward", "W weight grad"])
    return save(fig, path)
