"""A study's report (`study.md`) and plot (`study_<name>.png`): step time, bytes per step and
speedup over single per configuration, with the spread over repeats."""

from __future__ import annotations

from pathlib import Path

from distft.bench.plots import pyplot, save
from distft.io.files import atomic_write_text


def _range(s: dict | None, fmt: str = "{:.3f}") -> str:
    if not s:
        return "-"
    return f"{fmt.format(s['median'])} [{fmt.format(s['min'])}-{fmt.format(s['max'])}]"


def _verdict(vs: dict | None) -> str:
    return f"{vs['ratio']:.2f}x time, {vs['verdict']}" if vs else "-"


def plot_study(summary: dict, path: Path) -> None:
    """Two panels, one bar per configuration (labels on the axis, no legend): step time (median,
    whiskers min-max, IQR as a thick line, zero-based) and bytes per step (log scale, when the
    bytes span orders of magnitude)."""
    rows = summary["rows"][::-1]  # first configuration on top
    labels = [r["label"] for r in rows]
    y = range(len(rows))
    plt = pyplot()
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 0.55 * len(rows) + 1.6), sharey=True)
    med = [r["step_time_s"]["median"] for r in rows]
    err = [[m - r["step_time_s"]["min"] for m, r in zip(med, rows, strict=True)],
           [r["step_time_s"]["max"] - m for m, r in zip(med, rows, strict=True)]]  # fmt: skip
    colors = ["#8C8C8C" if r["strategy"] == "single" else "#4C72B0" for r in rows]
    ax_t.barh(list(y), med, xerr=err, capsize=4, color=colors)
    for i, r in enumerate(rows):
        s = r["step_time_s"]
        ax_t.plot([s["q1"], s["q3"]], [i, i], color="black", linewidth=3)
    ax_t.set_xlim(left=0)
    ax_t.set_yticks(list(y), labels)
    ax_t.set_xlabel("step time, s (median; whiskers min-max, thick: IQR)")
    byte_values = [r["bytes"] / 2**20 for r in rows]  # MiB
    ax_b.barh(list(y), byte_values, color=colors)
    for i, (r, b) in enumerate(zip(rows, byte_values, strict=True)):
        ax_b.annotate(f"{r['bytes'] / 2**20:,.3g} MiB, {r['calls']:g} calls", (b, i), xytext=(3, 0),
                      textcoords="offset points", va="center", fontsize=8)  # fmt: skip
    positive = [r["bytes"] for r in rows if r["bytes"] > 0]
    if positive and max(positive) / min(positive) > 100:
        ax_b.set_xscale("log")
        ax_b.set_xlabel("MiB per optimizer step, rank 0 (log scale; no bar: none)")
    else:
        ax_b.set_xlim(left=0, right=max(max(byte_values), 1e-9) * 1.6)
        ax_b.set_xlabel("MiB per optimizer step, rank 0")
    fig.suptitle(f"distft bench --study {summary['study']}: {summary['repeats']} repeats per configuration")
    save(fig, path)


def write_study_report(summary: dict, out: Path) -> Path:
    plot = out / f"study_{summary['study']}.png"
    plot_study(summary, plot)
    s, env = summary["settings"], summary["environment"]
    lines = [
        f"# distft bench --study {summary['study']}",
        "",
        f"Model `{s['model']}`, global batch {s['global_batch_size']}, micro-batch {s['micro_batch_size']}, "
        f"max length {s['seq_len']}, {s['warmup']} warm-up + {s['steps']} measured steps per run, "
        f"{summary['repeats']} repeats per configuration, interleaved; {s['nproc']} processes.",
        f"Machine: {env['processor']}, {env['cpu_count']} CPUs, {env['device']}, backend {env['backend']}; "
        f"torch {env['torch']}, transformers {env['transformers']}, peft {env['peft']}, python {env['python']}.",
        "",
        "Step time: per run the median over its measured steps; here the median [min-max] over repeats. "
        "Bytes and calls: rank 0, the last measured step. Overlap: the share of communication time "
        "during which this rank computed (`distft.measure.overlap`).",
        "",
        "| configuration | switches | ranks | step time, s | IQR, s | speedup vs single | vs correct | "
        "bytes / step | calls / step | comm, ms | exposed, ms | overlap |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["rows"]:
        t, sp, vs = r["step_time_s"], r.get("speedup"), r.get("vs_correct")
        ms = {"median": 1e3, "min": 1e3, "max": 1e3}
        comm = {k: r["comm_s"][k] * ms[k] for k in ms} if r["comm_s"] else None
        exposed = {k: r["comm_exposed_s"][k] * ms[k] for k in ms} if r["comm_exposed_s"] else None
        lines.append(
            f"| {r['label']} | {' '.join(f'`{x}`' for x in r['switches']) or '-'} | {r['ranks']} | {_range(t)} | "
            f"{t['q1']:.3f}-{t['q3']:.3f} | {_range(sp, '{:.2f}x') if sp else '-'} | "
            f"{_verdict(vs)} | {r['bytes']:,.0f} | {r['calls']:g} | "
            f"{_range(comm, '{:.1f}')} | {_range(exposed, '{:.1f}')} | {_range(r['overlap_fraction'], '{:.0%}')} |"
        )
    lines += ["", f"![{summary['study']}]({plot.name})", "", "## Verdicts", ""]
    for r in summary["rows"]:
        vs = r.get("vs_correct")
        if vs:
            if vs["verdict"] == "spreads overlap":
                lines.append(f"- {r['label']}: no winner: its step-time range overlaps the correct run's "
                             f"(median ratio {vs['ratio']:.2f}x).")  # fmt: skip
            else:
                lines.append(f"- {r['label']}: {vs['verdict']} than the correct run ({vs['ratio']:.2f}x its median "
                             "step time; the min-max ranges do not overlap).")  # fmt: skip
    agree = summary["loss_agreement"]
    lines += ["", "## Do they train the same thing?", ""]
    lines += [f"- {k}: {'agrees' if v['agrees'] else 'DIFFERS'} (max relative loss difference "
              f"{v['max_relative_difference']:.1e})" for k, v in agree.items()]  # fmt: skip
    if summary["failures"]:
        lines += ["", "## Failed", ""] + [f"- {k}: {v}" for k, v in summary["failures"].items()]
    lines += ["", "## Config (the correct run)", "", "```toml", summary["config"].strip(), "```", ""]
    path = out / "study.md"
    atomic_write_text(path, "\n".join(lines))
    return path
