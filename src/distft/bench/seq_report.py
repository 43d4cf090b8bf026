"""The sequence sweep's report (`report.md`) and plot (`seq_sweep.png`): per strategy x lever x
length, tokens/s, MFU, memory (peak on CUDA, kept activations everywhere, against the plan) and
whether it fit; then where each series stopped and why."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from distft.bench.plots import legend_outside, pyplot, save
from distft.bench.seq_sweep import SeqSweepSettings
from distft.io.files import atomic_write_text

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MIB = 2**20


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MIB:,.1f} MiB"


def _row(p: dict, cuda: bool) -> str:
    head = f"| {p['strategy']} | {p['lever']} | {p['length']:,} |"
    if p["result"] != "fits":
        return head + " - | - | - | - | - | - | - | **" + p["result"] + "** |"
    planned = p["activations_predicted"]
    ratio = f"{p['activations_measured'] / planned:.2f}" if planned else "n/a"
    mfu = f"{p['mfu']:.1%}" if p["mfu"] is not None else "n/a"
    peak = _mib(p["peak_mem_bytes"]) if cuda else "n/a (CPU)"
    filled = "" if p["tokens_per_step"] == p["expected_tokens_per_step"] else " (short!)"
    return (
        f"{head} {p['tokens_per_step']:,.0f}{filled} | {p['tokens_per_s']:,.0f} | {mfu} | {peak} | "
        f"{_mib(p['activations_measured'])} | {_mib(planned)} | {ratio} | fits |"
    )


def render(summary: dict) -> str:
    """The report's markdown: what ran, the table, and where each series stopped."""
    s, env = summary["settings"], summary["environment"]
    cuda = env["device"] != "cpu"
    argv = SeqSweepSettings(**s).argv(Path(summary.get("out", "DIR")))
    fits = [p for p in summary["points"] if p["result"] == "fits"]
    filled = all(p["tokens_per_step"] == p["expected_tokens_per_step"] for p in fits)
    lines = [
        "# Sequence sweep: how long a sequence each strategy and lever trains on",
        "",
        f"`{shlex.join(['distft', *argv])}`",
        "",
        f"{env['device']}, torch {env['torch']}, {env['cpu_count']} CPU cores. Each run: `distft train` with "
        f"`data.max_length` = the length, {s['global_batch_size']} sequence(s) per step, {s['micro_batch_size']} per "
        f"micro-batch, {s['warmup']} unmeasured + {s['steps']} measured step(s) (figures: medians over the measured "
        "ones), on the bundled meetings joined end to end and cut to the length (`DIR/data/long.jsonl`). "
        f"Tokens per step equal sequences x length in every run that fit: **{'yes' if filled else 'NO'}**. "
        f"Activations: what autograd kept for the first micro-batch on the fullest rank, against `distft plan` "
        f"for the same layout at {summary['label_tokens']:.0f} labelled positions a row (the summaries').",
        "",
        *[f"- {note}" for note in summary["notes"]],
        *([""] if summary["notes"] else []),
        "| strategy | lever | length | tokens/step | tokens/s | MFU | peak memory | activations measured | "
        "activations planned | measured / planned | result |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        *[_row(p, cuda) for p in summary["points"]],
        "",
        "Where each series stopped:",
        "",
        *[
            f"- {r['strategy']}, {r['lever']}: longest that fit "
            f"{'none' if r['longest_fit'] is None else format(r['longest_fit'], ',')}; {r['stopped']}"
            for r in summary["series"]
        ],
    ]
    for name, error in summary["failures"].items():
        lines += ["", f"{name} failed: {error}"]
    lines += ["", "![peak memory and tokens/s against the sequence length](seq_sweep.png)"]
    return "\n".join(lines) + "\n"


def plot_seq_sweep(summary: dict, path: Path) -> Figure:
    """Two panels against the sequence length (log2 axis), one colour per strategy x lever: memory
    (CUDA: peak; the CPU: kept activations, solid, and the plan's, dashed) and tokens/s; an x marks
    the length a series ran out of memory at, drawn at its last figure."""
    cuda = summary["environment"]["device"] != "cpu"
    plt = pyplot()
    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(summary["series"]):
        mine = [p for p in summary["points"] if (p["strategy"], p["lever"]) == (r["strategy"], r["lever"])]
        fit = [p for p in mine if p["result"] == "fits"]
        colour, label = colours[i % len(colours)], f"{r['strategy']}, {r['lever']}"
        x = [p["length"] for p in fit]
        memory = [(p["peak_mem_bytes"] if cuda else p["activations_measured"]) / MIB for p in fit]
        ax_m.plot(x, memory, "o-", color=colour, label=label)
        planned = [(p["length"], p["activations_predicted"] / MIB) for p in fit if p["activations_predicted"]]
        if planned:
            ax_m.plot(*zip(*planned, strict=True), "--", color=colour, label=f"{label}: plan's activations")
        ax_t.plot(x, [p["tokens_per_s"] for p in fit], "o-", color=colour, label=label)
        oom = [p["length"] for p in mine if p["result"] == "out of memory"]
        if oom and fit:
            ax_m.plot(oom, memory[-1:], "x", color="red", markersize=10, label=f"{label}: out of memory")
    for ax in (ax_m, ax_t):
        ax.set_xscale("log", base=2)
        ax.set_xticks(summary["lengths"], [f"{n:,}" for n in summary["lengths"]], rotation=45, fontsize=7)
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("sequence length, tokens (log2 scale)")
    what = "peak memory (torch.cuda.max_memory_allocated)" if cuda else "activations kept for backward"
    ax_m.set_ylabel(f"MiB per rank (fullest): {what}", fontsize=8)
    ax_t.set_ylabel("tokens / s (median of the measured steps)", fontsize=8)
    ax_m.set_title("Memory vs sequence length")
    ax_t.set_title("Throughput vs sequence length")
    legend_outside(ax_t, *ax_m.get_legend_handles_labels())  # one legend, right of both panels
    return save(fig, path)


def write_seq_report(summary: dict, out: Path) -> Path:
    """`out/report.md` and `out/seq_sweep.png`."""
    plot_seq_sweep(summary, out / "seq_sweep.png")
    path = out / "report.md"
    atomic_write_text(path, render(summary | {"out": str(out)}))
    return path
