"""The benchmark's devlog: `report.md` with its tables and PNG plots (matplotlib)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

KINDS = ["all_reduce", "all_gather", "reduce_scatter", "send", "recv", "broadcast", "all_to_all"]


def _mib(n: float) -> str:
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


def plot_memory(results: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels, peak, saved = [], [], []
    for r in results:
        for rank in r["ranks"]:
            labels.append(f"{r['strategy']}\nr{rank['rank']}")
            peak.append(rank["peak_mem_bytes"] / 2**20)
            saved.append(rank["saved_activation_bytes"] / 2**20)
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], peak, width=0.4, label="peak memory (RSS on CPU, allocated on CUDA)")
    ax.bar([i + 0.2 for i in x], saved, width=0.4, label="activations saved for backward (1 micro-batch)")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("MiB per rank")
    ax.legend(fontsize=7)
    ax.set_title("Memory per rank")
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


def write_report(summary: dict, out: Path) -> Path:
    results = summary["results"]
    plots = {
        "throughput.png": plot_throughput,
        "memory.png": plot_memory,
        "comm.png": plot_comm,
        "losses.png": plot_losses,
    }
    for name, plot in plots.items():
        plot(results, out / name)

    s, env = summary["settings"], summary["environment"]
    lines = [
        "# distft bench",
        "",
        f"Measured on {env['device']} ({env['processor']}, {env['cpu_count']} CPU cores, backend {env['backend']}), "
        f"torch {env['torch']}, transformers {env['transformers']}, peft {env['peft']}.",
        "",
        f"Model `{s['model']}`, global batch {s['global_batch_size']} (micro-batch {s['micro_batch_size']}), "
        f"max length {s['seq_len']}, seed {s['seed']}; {s['warmup']} warm-up steps, then {s['steps']} measured. "
        f"Multi-process strategies ran on {s['nproc']} processes. Raw figures: `results.json`.",
        "",
        "## Throughput and memory (measured)",
        "",
        "| strategy | ranks | step time (s, median [min-max]) | tokens/s (median) | peak memory per rank (MiB) "
        "| activations saved per rank (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        st, peak = r["step_time_s"], [_mib(x["peak_mem_bytes"]) for x in r["ranks"]]
        saved = [_mib(x["saved_activation_bytes"]) for x in r["ranks"]]
        lines.append(
            f"| {r['strategy']} | {r['world_size']} | {st['median']:.3f} [{st['min']:.3f}-{st['max']:.3f}] "
            f"| {r['tokens_per_s']['median']:,.0f} | {' / '.join(peak)} | {' / '.join(saved)} |"
        )
    lines += ["", "![throughput](throughput.png)", "", "![memory](memory.png)", ""]

    lines += [
        "## Bytes moved per optimizer step (rank 0, measured vs analytic)",
        "",
        "Sizes of the logical tensors each collective carried (see `distft/comm.py`), counted on the "
        "first step by a dispatch mode that sees every collective, against each strategy's own formula.",
        "",
        "| strategy | collective | measured (MiB) | analytic (MiB) | match |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        kinds = sorted(set(r["comm_bytes"]) | set(r["comm_bytes_expected"])) or ["(none)"]
        for kind in kinds:
            got, want = r["comm_bytes"].get(kind, 0), r["comm_bytes_expected"].get(kind)
            match = "-" if want is None else ("yes" if got == want else f"off by {got - want:+,} B")
            lines.append(
                f"| {r['strategy']} | {kind} | {_mib(got)} | {'-' if want is None else _mib(want)} | {match} |"
            )
    lines += ["", "![bytes per collective](comm.png)", ""]

    lines += ["## Do they train the same thing?", ""]
    for name, agreement in summary["loss_agreement"].items():
        verdict = "agrees" if agreement["agrees"] else "**DIVERGES**"
        lines.append(
            f"- {name}: {verdict} with {results[0]['strategy']} "
            f"(largest relative loss difference {agreement['max_relative_difference']:.1e})"
        )
    lines += ["", "![losses](losses.png)", ""]

    if summary.get("overhead_ratio"):
        plain = summary["plain_loop"]["step_time_s"]["median"]
        lines += [
            "## distft's own overhead",
            "",
            f"The plain torch + peft loop (`distft/bench/reference.py`) takes {plain:.3f} s per step on one "
            f"device; distft's `single` strategy takes {summary['overhead_ratio']:.2f}x that. Below 1 means "
            "distft is faster: its loss head runs lm_head on the summary tokens only.",
            "",
        ]
    if summary["failures"]:
        lines += ["## Failures", ""] + [f"- {k}: {v}" for k, v in summary["failures"].items()] + [""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report
