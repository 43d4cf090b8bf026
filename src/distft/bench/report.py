"""The benchmark's devlog: `report.md`, one section per question, each with its table and plot."""

from __future__ import annotations

from pathlib import Path

from distft.bench.plots import (
    COMPONENTS,
    measured_components,
    mib,
    plot_comm,
    plot_losses,
    plot_memory,
    plot_pp_gantt,
    plot_pp_idle,
    plot_throughput,
)
from distft.bench.pp_report import gantt_charts, pipeline_section
from distft.bench.spread import ranking_sentence
from distft.io.files import atomic_write_text


def memory_section(summary: dict) -> list[str]:
    plan = summary.get("plan_memory") or {"strategies": {}, "precision": "?"}
    lines = [
        "## Memory by component: measured vs `distft plan`",
        "",
        "Measured per rank: parameters and gradients are the local storage of the rank's parameters "
        "(gradients have their parameters' shapes and are freed between steps), optimizer state the "
        "AdamW tensors after the last step, activations what autograd saved for one micro-batch on the "
        f"first step. The plan's figures (precision `{plan['precision']}`, {plan.get('label_tokens', 256)} "
        "loss positions per sequence: the data's median summary) are for its fullest rank, with the "
        "activations saved for every in-flight micro-batch (the loss's transient logits left out) at the "
        "full sequence length, where the measurement saw one micro-batch of real, often shorter sequences.",
        "",
        "| strategy | rank | parameters | gradients | optimizer state | activations | plan: parameters "
        "| plan: gradients | plan: optimizer state | plan: activations |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["results"]:
        predicted = plan["strategies"].get(r["strategy"], {})
        pcells = [mib(predicted[k]) if k in predicted else "-" for _, k, _ in COMPONENTS]
        for rank in r["ranks"]:
            m = measured_components(rank)
            cells = [mib(m[label]) for _, _, label in COMPONENTS]
            lines.append(f"| {r['strategy']} | {rank['rank']} | {' | '.join(cells)} | {' | '.join(pcells)} |")
    lines += ["", "MiB. ![memory](memory.png)", ""]
    return lines


def projection_section(projections: list[dict]) -> list[str]:
    if not projections:
        return []
    lines = [
        "## Projected (not measured): the measured bytes and the plan's compute on other hardware",
        "",
        "Compute per rank: the plan's FLOPs for each strategy's layout / (the GPU's dense bf16 peak x "
        f"{projections[0]['mfu']:.0%} MFU). Communication: the bytes and calls measured per collective on "
        "the first step, through the profile's ring `comm_time` (a recv is the other direction of a send). "
        "Overlap: the strategy's measured overlap fraction (the section above) hides that share of its "
        "communication, at most behind the whole compute; where a run has none (results from before the "
        "measurement), the plan's assumption: DDP's, ZeRO-2's and FSDP's collectives hide behind compute, "
        "TP's, TP+SP's and the pipeline's sit on the critical path. The CPU's overlap is a poor stand-in "
        "for a GPU's, so these projections are pessimistic for DDP and FSDP on NCCL. A pipeline adds its "
        "bubble. Tokens per step are the "
        "measured ones. These figures are for the benchmarked model and batch: a small model is "
        "latency-bound on fast hardware, so they say little about a 4B model (ask `distft plan`).",
        "",
    ]
    for p in projections:
        lines += [
            f"### projected: {p['profile']} ({p['gpus']} x {p['gpu']}, {p['link']})",
            "",
            "| strategy | ranks | compute (ms) | comm (ms) | overlap used | exposed comm (ms) | bubble (ms) "
            "| step (ms) | tokens/s | vs one GPU |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, row in p["strategies"].items():
            if "note" in row:
                lines.append(f"| {name} | {row['ranks']} | not estimated: {row['note']} | | | | | | | |")
                continue
            vs = "-" if row["speedup_vs_single"] is None else f"{row['speedup_vs_single']:.2f}x"
            overlap = row.get("overlap")
            used = "-" if not row["comm_s"] else "assumed" if overlap is None else f"{overlap:.0%} measured"
            lines.append(
                f"| {name} | {row['ranks']} | {row['compute_s'] * 1e3:.3f} | {row['comm_s'] * 1e3:.3f} | {used} "
                f"| {row['exposed_comm_s'] * 1e3:.3f} | {row['bubble_s'] * 1e3:.3f} | {row['step_s'] * 1e3:.3f} "
                f"| {row['tokens_per_s']:,.0f} | {vs} |"
            )
        lines += ["", f"Projected winner on {p['profile']}: **{p['winner']}**.", ""]
        for c in p["claims"]:
            verdict = "supports" if c["supported"] else "does not support"
            lines.append(
                f'- The blog series\' claim "{c["claim"]}": the projection {verdict} it ({c["evidence"]}).'
            )
        lines.append("")
    return lines


def write_report(summary: dict, out: Path) -> Path:
    """`out/report.md` and its plots, from the summary `run_bench` wrote to results.json."""
    write_plots(summary, out)
    lines = [
        *header_section(summary),
        *throughput_section(summary),
        *memory_section(summary),
        *comm_section(summary),
        *overlap_section(summary),
        *agreement_section(summary),
        *pipeline_section(summary, out),
        *overhead_section(summary),
        *projection_section(summary.get("projections") or []),
    ]
    if summary["failures"]:
        lines += ["## Failures", ""] + [f"- {k}: {v}" for k, v in summary["failures"].items()] + [""]
    report = out / "report.md"
    atomic_write_text(report, "\n".join(lines))
    return report


def write_plots(summary: dict, out: Path) -> None:
    results = summary["results"]
    plots = {"throughput.png": plot_throughput, "comm.png": plot_comm, "losses.png": plot_losses}
    for name, plot in plots.items():
        plot(results, out / name)
    plot_memory(results, out / "memory.png", summary.get("plan_memory"))
    sweep = summary.get("pp_sweep") or []
    if sweep:
        plot_pp_idle(sweep, out / "pp_idle.png")
        for name, run in gantt_charts(sweep).items():
            plot_pp_gantt(run["timeline"], out / name)


def header_section(summary: dict) -> list[str]:
    s, env = summary["settings"], summary["environment"]
    return [
        "# distft bench",
        "",
        f"Measured on {env['device']} ({env['processor']}, {env['cpu_count']} CPU cores, backend {env['backend']}), "
        f"torch {env['torch']}, transformers {env['transformers']}, peft {env['peft']}.",
        "",
        f"Model `{s['model']}`, global batch {s['global_batch_size']} (micro-batch {s['micro_batch_size']}), "
        f"max length {s['seq_len']}, seed {s['seed']}; {s['warmup']} warm-up steps, then {s['steps']} measured. "
        f"Multi-process strategies ran on {s['nproc']} processes. Raw figures: `results.json`.",
        "",
    ]


def throughput_section(summary: dict) -> list[str]:
    results = summary["results"]
    repeats = summary["settings"].get("repeats", 1)
    over = (
        f"median [min-max] over {repeats} interleaved runs, each run's figure the median of its measured steps"
        if repeats > 1
        else "median [min-max] over the measured steps of one run"
    )
    lines = [
        "## Throughput and memory (measured)",
        "",
        f"Step time and tokens/s: {over}.",
        "",
        "| strategy | ranks | step time (s, median [min-max]) | tokens/s (median [min-max]) | MFU (median) "
        "| peak memory per rank (MiB) | activations saved per rank (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        st, tps, peak = r["step_time_s"], r["tokens_per_s"], [mib(x["peak_mem_bytes"]) for x in r["ranks"]]
        saved = [mib(x["saved_activation_bytes"]) for x in r["ranks"]]
        mfu = f"{r['extra']['mfu']:.1%}" if "mfu" in r.get("extra", {}) else "n/a"  # null off a known GPU
        lines.append(
            f"| {r['strategy']} | {r['world_size']} | {st['median']:.3f} [{st['min']:.3f}-{st['max']:.3f}] "
            f"| {tps['median']:,.0f} [{tps['min']:,.0f}-{tps['max']:,.0f}] | {mfu} | {' / '.join(peak)} "
            f"| {' / '.join(saved)} |"
        )
    sentence = ranking_sentence({r["strategy"]: r["tokens_per_s"] for r in results}, "tokens/s")
    if sentence:
        lines += ["", sentence]
    for r in results:
        if "idle_fraction" in r.get("extra", {}):
            x = r["extra"]
            modelled = x.get("idle_fraction_modelled")  # absent from results made before the cost model
            model = "" if modelled is None else f", {modelled:.0%} by the cost model for its cut"
            lines += ["", f"{r['strategy']}: each rank idles {x['idle_fraction']:.0%} of the step (median over the "
                      f"measured steps; {x['idle_fraction_theory']:.0%} in theory with equal stages{model})."]  # fmt: skip
    return [*lines, "", "![throughput](throughput.png)", ""]


def overlap_section(summary: dict) -> list[str]:
    """Per strategy with communication: how long it ran per step, how much of it no compute hid,
    and the overlap fraction (`distft.measure.overlap`), rank 0, median over the measured steps."""
    rows = [r for r in summary["results"] if r.get("extra", {}).get("comm_s") is not None]
    if not rows:
        return []
    lines = [
        "## Communication time and overlap (measured)",
        "",
        "Rank 0, median over the measured steps (with repeats: the median over runs, [min-max] over runs): "
        "`comm` is the union of the collectives' intervals (issued to completed), `exposed` the part of it "
        "during which this rank ran no compute, overlap = 1 - exposed / comm. On a CPU with gloo the "
        "collectives compete with compute for the same cores: overlap here is concurrency, not free time.",
        "",
        "| strategy | comm per step (ms) | exposed (ms) | overlap |",
        "|---|---|---|---|",
    ]

    def cell(x: dict, key: str, fmt: str, scale: float = 1.0) -> str:
        if x.get(key) is None:
            return "-"
        text = fmt.format(x[key] * scale)
        lo_hi = x.get(f"{key}_range")
        return text + (f" [{fmt.format(lo_hi[0] * scale)}-{fmt.format(lo_hi[1] * scale)}]" if lo_hi else "")

    for r in rows:
        x = r["extra"]
        lines.append(
            f"| {r['strategy']} | {cell(x, 'comm_s', '{:.1f}', 1e3)} | {cell(x, 'comm_exposed_s', '{:.1f}', 1e3)} "
            f"| {cell(x, 'overlap_fraction', '{:.0%}')} |"
        )
    return [*lines, ""]


def comm_section(summary: dict) -> list[str]:
    lines = [
        "## Bytes moved per optimizer step (rank 0, measured vs analytic)",
        "",
        "Sizes of the logical tensors each collective carried (see `distft/measure/comm.py`), counted on the "
        "first step by a dispatch mode that sees every collective, against each strategy's own formula.",
        "",
        "| strategy | collective | measured (MiB) | analytic (MiB) | match |",
        "|---|---|---|---|---|",
    ]
    for r in summary["results"]:
        kinds = sorted(set(r["comm_bytes"]) | set(r["comm_bytes_expected"])) or ["(none)"]
        for kind in kinds:
            got, want = r["comm_bytes"].get(kind, 0), r["comm_bytes_expected"].get(kind)
            match = "-" if want is None else ("yes" if got == want else f"off by {got - want:+,} B")
            if kind == "all_to_all" and want is not None and got != want:  # planned as the ranks' mean
                match = routed_match(r["ranks"])
            lines.append(
                f"| {r['strategy']} | {kind} | {mib(got)} | {'-' if want is None else mib(want)} | {match} |"
            )
    return [*lines, "", "![bytes per collective](comm.png)", ""]


def routed_match(ranks: list[dict]) -> str:
    """fsdp+ep's all-to-alls: a rank's combine sends the rows its experts took, which the routing
    decides, so each is planned as the mean; the sum over the ranks is the exact count."""
    comm = [rank.get("comm_bytes_per_step", {}) for rank in ranks]
    got, want = (sum(c.get(side, {}).get("all_to_all", 0) for c in comm) for side in ("counted", "predicted"))
    verdict = "yes" if got == want else f"off by {got - want:+,} B"
    return f"{verdict}, summed over the ranks (a rank's share is the routing's)"


def agreement_section(summary: dict) -> list[str]:
    lines = ["## Do they train the same thing?", ""]
    first = summary["results"][0]["strategy"]
    for name, agreement in summary["loss_agreement"].items():
        verdict = "agrees" if agreement["agrees"] else "**DIVERGES**"
        lines.append(
            f"- {name}: {verdict} with {first} "
            f"(largest relative loss difference {agreement['max_relative_difference']:.1e})"
        )
    repeats = {r["strategy"]: r["extra"]["repeat_loss_max_relative_difference"] for r in summary["results"]
               if "repeat_loss_max_relative_difference" in r.get("extra", {})}  # fmt: skip
    if repeats:
        worst = max(repeats.values())
        verdict = (
            "gave the same losses" if worst <= 1e-4 else "**did not give the same losses**"
        )  # as loss_agreement
        lines += ["", f"Repeats: every strategy's {summary['settings']['repeats']} runs {verdict} "
                  f"(largest relative difference between a repeat and its first run {worst:.1e})."]  # fmt: skip
    return [*lines, "", "![losses](losses.png)", ""]


def overhead_section(summary: dict) -> list[str]:
    if not summary.get("overhead_ratio"):
        return []
    plain = summary["plain_loop"]["step_time_s"]["median"]
    return [
        "## distft's own overhead",
        "",
        f"The plain torch + peft loop (`distft/bench/reference.py`) takes {plain:.3f} s per step on one "
        f"device; distft's `single` strategy takes {summary['overhead_ratio']:.2f}x that. Below 1 means "
        "distft is faster: its loss head runs lm_head on the summary tokens only.",
        "",
    ]
