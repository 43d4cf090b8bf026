"""The plan as a rich table and a walk through the decision tree, or as one JSON document.

Each layout's row gives its step time, tokens/s and, when the run's length is known (`--tokens`
with `--epochs`, or `--steps`), the hours of the whole run; the recommendation says the same in
a sentence (`timing` has the model and its assumptions). A device with no bf16 peak gets "n/a"
and the reason, never a number."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

from distft.parallel.pipeline.cost import even_cut, imbalance
from distft.plan.estimate import Estimate, Request, estimate, max_micro_batch
from distft.plan.explain import Recommendation
from distft.plan.hardware import format_bytes, format_seconds
from distft.plan.inputs import Parallelism, cost_model, pipeline_layout
from distft.plan.longest import longest_sequences, positions_limit
from distft.plan.memory import trainable_params
from distft.plan.run_line import run_command
from distft.plan.timing import MFU_SOURCE, MOE_MFU_NOTE, format_duration

OVERLAP = (
    "DDP's, FSDP's and HSDP's collectives and a pipeline's sends overlap compute and only their excess "
    "shows; TP's and TP+SP's, ZeRO-1's broadcast and partial-gradient all-reduces add their whole time"
)


def _command(req: Request, rec: Recommendation) -> str | None:
    return run_command(req, rec.strategy, rec.method, rec.activation_checkpointing, rec.parallelism)


def largest_micro_batch(req: Request, rec: Recommendation) -> int | None:
    """The largest micro-batch the recommendation fits with (its method and checkpointing)."""
    if rec.strategy is None or rec.parallelism is None:
        return None
    t = replace(req.training, method=rec.method, activation_checkpointing=rec.activation_checkpointing)
    return max_micro_batch(replace(req, training=t), rec.parallelism, rec.strategy)


def recommended(req: Request, rec: Recommendation) -> Estimate | None:
    """The recommendation's own estimate (its method and checkpointing may differ from the request's)."""
    if rec.strategy is None or rec.parallelism is None:
        return None
    t = replace(req.training, method=rec.method, activation_checkpointing=rec.activation_checkpointing)
    return estimate(replace(req, training=t), rec.parallelism, rec.strategy)


def mfu_source(req: Request) -> str:
    """Where the assumed MFU comes from: --mfu, or distft's dense measurement (said so for an MoE)."""
    if req.mfu:
        return "--mfu"
    return f"{MFU_SOURCE}; {MOE_MFU_NOTE}" if req.model.moe else MFU_SOURCE


def time_model(req: Request) -> dict:
    """The time model's inputs and assumptions (JSON)."""
    return {
        "mfu_assumed": req.assumed_mfu,
        "mfu_source": mfu_source(req),
        "peak_bf16_tflops": req.gpu.bf16_tflops,
        "overlap": OVERLAP,
        "tokens": req.run.tokens,
        "epochs": req.run.epochs,
        "steps": req.run.steps,
        "unavailable": req.no_time,  # why no layout has a time (None: they all do)
    }


def time_dict(e: Estimate) -> dict | None:
    """One layout's predicted time (JSON); None without a bf16 peak."""
    t = e.time
    if t is None:
        return None
    return {
        "step_seconds": t.seconds,
        "compute_seconds": t.compute_s,
        "bubble_seconds": t.bubble_s,
        "exposed_communication_seconds": t.exposed_comm_s,
        "idle_fraction": t.idle_fraction,
        "model_flops_per_step": t.flops,
        "tokens_per_second": e.tokens_per_s,
        "steps": e.run_steps,
        "train_seconds": e.train_s,
        "train_hours": e.train_s / 3600 if e.train_s else None,
    }


def time_line(req: Request, e: Estimate | None) -> str:
    """The recommendation's time, as a sentence."""
    if req.no_time:
        return f"n/a ({req.no_time})"
    if e is None or e.step_s is None:
        return "n/a"
    line = f"{format_seconds(e.step_s)} per step, {e.tokens_per_s:,.0f} tokens/s"
    if e.run_steps is None:
        return line + f"; {req.run.describe()}"
    per_step = "" if req.run.steps else f" / {e.tokens_per_step:,} tokens per step"
    return (
        line + f"; {e.run_steps:,} steps ({req.run.describe()}{per_step}): {format_duration(e.train_s)} "
        f"on {req.world} GPU{'s' if req.world > 1 else ''}"
    )


def to_dict(req: Request, estimates: dict[str, Estimate], rec: Recommendation) -> dict:
    t = req.training
    return {
        "model": {
            "name": req.model.name,
            "source": req.model.source,
            "parameters": req.model.num_params(),
            "trainable_parameters": trainable_params(req.model, t),
            "architecture": {k: v for k, v in asdict(req.model).items() if k not in ("name", "source")},
        },
        "training": {
            "method": t.method,
            "precision": asdict(t.precision),
            "seq_len": t.seq_len,
            "micro_batch": t.micro_batch,
            "grad_accum": req.grad_accum,
            "label_tokens": t.label_tokens,
            "activation_checkpointing": t.activation_checkpointing,
            "attention": t.attention,
            "padding_mask": t.has_padding_mask,
            "lora": {"rank": t.lora_rank, "targets": list(t.lora_targets)} if t.lora else None,
        },
        "hardware": {
            "gpu": asdict(req.gpu),
            "gpu_memory_bytes": req.gpu_memory,
            "overhead_bytes": req.overhead,
            "usable_bytes": req.usable,
            "gpus_per_node": req.gpus_per_node,
            "nodes": req.nodes,
            "intra_node_link": asdict(req.intra),
            "inter_node_link": asdict(req.inter) if req.nodes > 1 else None,
            "mfu_assumed": req.assumed_mfu,
            "vendor_figures": {
                "gpu": list(type(req.gpu).VENDOR_FIELDS) if req.gpu.vendor else [],
                "links": list(type(req.intra).VENDOR_FIELDS),
                "assumed": [*type(req.intra).ASSUMED_FIELDS, "mfu_assumed", "overhead_bytes"],
            },
        },
        "time_model": time_model(req),
        "strategies": [_estimate_dict(e) for e in estimates.values()],
        "longest_sequence": {
            "positions": positions_limit(req),
            "per_strategy": longest_sequences(req, applicable(estimates)),
        },
        "recommendation": {
            "strategy": rec.strategy,
            "label": rec.label,
            "method": rec.method,
            "activation_checkpointing": rec.activation_checkpointing,
            "layout": layout_dict(rec.parallelism) if rec.parallelism else None,
            "reason": rec.reason,
            "steps": [asdict(s) for s in rec.steps],
            "alternatives": rec.alternatives,
            "command": _command(req, rec),
            "max_micro_batch": largest_micro_batch(req, rec),
            "time": time_dict(chosen) if (chosen := recommended(req, rec)) else None,
        },
    }


def layout_dict(par: Parallelism) -> dict:
    """A layout as JSON: its mesh (and the degrees as the planner names them), its schedule, and
    what its strategy's spec says it shards."""
    spec = ("shard", "reshard_after_forward", "tensor_parallel")
    return asdict(par) | {k: getattr(par, k) for k in ("dp", "dp_shard", "tp", "pp", "cp", "ep", *spec)}


def _estimate_dict(e: Estimate) -> dict:
    return {
        "strategy": e.strategy,
        "label": e.label,
        "applicable": e.applicable,
        "note": e.note,
        "in_distft": e.in_distft,
        "runnable": e.runnable,
        "layout": layout_dict(e.parallelism),
        "stage": e.stage,
        "bytes_per_gpu": {**e.components, "total": e.total},
        "activation_detail": e.activation_detail,
        "buffer_detail": e.buffer_detail,
        "fits": e.fits,
        "communication": {
            "wire_bytes_per_step": e.comm_bytes,
            "seconds_per_step": e.comm_s,
            "collectives": [
                {
                    "what": c.what,
                    "kind": c.kind,
                    "logical_bytes": c.logical_bytes,
                    "wire_bytes": c.wire_bytes,
                    "calls": c.calls,
                    "group": c.group,
                    "link": c.link.name,
                    "overlapped": c.overlapped,
                    "seconds": c.seconds,
                }
                for c in e.collectives
            ],
        },
        "compute_seconds_per_step": e.compute_s,
        "step_seconds": e.step_s,
        "tokens_per_step": e.tokens_per_step,
        "tokens_per_second": e.tokens_per_s,
        "min_global_batch": e.min_global_batch,
        "time": time_dict(e),
    }


def applicable(estimates: dict[str, Estimate]) -> list[str]:
    return [name for name, e in estimates.items() if e.applicable]


def print_json(req: Request, estimates: dict[str, Estimate], rec: Recommendation) -> None:
    print(json.dumps(to_dict(req, estimates, rec), indent=1))


COLUMNS = (
    "strategy", "params", "grads", "optimizer", "activations", "buffers", "total", "fits",
    "comm/step", "comm time", "step", "tokens/s", "run", "distft",
)  # fmt: skip


def rich_table(req: Request, estimates: dict[str, Estimate]):
    """One row per applicable layout (`COLUMNS`; "run" only when the run's length is known), and
    the layouts that do not apply, with why."""
    from rich.table import Table

    table = Table(
        title="bytes per GPU (the fullest rank), traffic and time per optimizer step", title_justify="left"
    )
    for col in (c for c in COLUMNS if c != "run" or req.run.known):
        left = col in ("strategy", "fits", "distft")
        table.add_column(col, justify="left" if left else "right", no_wrap=col == "strategy")
    skipped = []
    for e in estimates.values():
        if not e.applicable:
            skipped.append(f"{e.label} ({e.note})")
            continue
        fits = "[green]yes[/]" if e.fits else "[red]no[/]"
        table.add_row(
            e.label,
            *(format_bytes(n) for n in [*e.components.values(), e.total]),
            fits,
            format_bytes(e.comm_bytes),
            format_seconds(e.comm_s),
            "n/a" if req.no_time else format_seconds(e.step_s),
            f"{e.tokens_per_s:,.0f}" if e.tokens_per_s else "-",
            *([format_duration(e.train_s)] if req.run.known else []),
            e.in_distft,
        )
    return table, skipped


def pipeline_cuts(req: Request, estimates: dict[str, Estimate]) -> list[str]:
    """Per pipelined layout: the cut the runtime makes (`parallel.pp_split`) and its modelled
    slowest / mean stage cost, beside the even cut's (`distft.parallel.pipeline.cost`)."""
    lines = []
    for e in estimates.values():
        par = e.parallelism
        if not e.applicable or par.pp < 2:
            continue
        costs = cost_model(req.model, req.training)
        lay = pipeline_layout(req.model, req.training, par)
        cut, even = lay.layers_per_stage, even_cut(costs.num_layers, lay.num_stages)
        lines.append(
            f"{e.strategy}: {lay.schedule}, {lay.num_stages} stages, cut {'/'.join(map(str, cut))} "
            f"(parallel.pp_split={par.pp_split}): slowest / mean stage {imbalance(costs.stage_costs(cut)):.3f}; "
            f"even cut {'/'.join(map(str, even))}: {imbalance(costs.stage_costs(even)):.3f}"
        )
    return lines


def print_rich(req: Request, estimates: dict[str, Estimate], rec: Recommendation) -> None:
    from rich.console import Console

    console = Console(width=max(Console().width, 185))
    t = req.training
    console.print(f"[bold]model[/] {req.model.describe()} [dim](from {req.model.source})[/]")
    trained = trainable_params(req.model, t)
    console.print(
        f"[bold]training[/] {t.method}, {trained / 1e6:,.1f}M trainable, {t.precision.name} precision "
        f"({t.precision.description}), seq {t.seq_len} x micro-batch {t.micro_batch} x accumulation "
        f"{req.grad_accum}, loss on {min(t.label_tokens, t.seq_len)} positions per sequence, {t.attention} attention, "
        f"activation checkpointing {t.activation_checkpointing}"
    )
    links = req.intra.label + (f" within nodes, {req.inter.label} between" if req.nodes > 1 else "")
    tflops = f", {req.gpu.bf16_tflops:g} bf16 TFLOP/s peak" if req.gpu.bf16_tflops else ""
    console.print(
        f"[bold]hardware[/] {req.world} x {req.gpu.label} ({req.nodes} node{'s' if req.nodes > 1 else ''}){tflops}; "
        f"{format_bytes(req.gpu_memory)} "
        f"each, {format_bytes(req.usable)} usable after {format_bytes(req.overhead)} overhead; {links}"
    )
    table, skipped = rich_table(req, estimates)
    console.print(table)
    if skipped:
        console.print(f"[dim]not applicable: {'; '.join(skipped)}[/]", highlight=False)
    longest = longest_sequences(req, applicable(estimates))
    levels = " / ".join(next(iter(longest.values()), {}))
    console.print(
        f"[bold]longest sequence that fits[/] (tokens, up to the model's {positions_limit(req):,} positions; "
        f"activation checkpointing {levels}): "
        + "; ".join(
            f"{estimates[s].label} {' / '.join(f'{n:,}' for n in by.values())}" for s, by in longest.items()
        ),
        highlight=False,
    )
    for line in pipeline_cuts(req, estimates):
        console.print(f"[dim]{line}[/]", highlight=False)
    console.print("[bold]decision[/]")
    for s in rec.steps:
        console.print(f"  [bold]{s.question}[/] {s.answer}", highlight=False)
    ckpt = (
        f" with activation checkpointing ({rec.activation_checkpointing})"
        if rec.activation_checkpointing != t.activation_checkpointing
        else ""
    )
    method = f" ({rec.method})" if rec.method != t.method else ""
    console.print(f"[bold green]recommendation: {rec.label}{method}{ckpt}[/] {rec.reason}", highlight=False)
    for a in rec.alternatives:
        console.print(f"  [dim]alternative:[/] {a}", highlight=False)
    if rec.strategy:
        console.print(f"  [dim]time:[/] {time_line(req, recommended(req, rec))}", highlight=False)
    if command := _command(req, rec):
        console.print(f"  [dim]run:[/] {command}", highlight=False)
    if largest := largest_micro_batch(req, rec):
        console.print(
            f"  [dim]largest micro-batch that fits:[/] {largest} sequences of {t.seq_len} tokens "
            f"(this plan: {t.micro_batch}); larger micro-batches feed the GPU better "
            "(train.micro_batch_size, with train.global_batch_size a multiple of it)",
            highlight=False,
        )
    mfu = f"MFU ({req.assumed_mfu:.0%}" + (")" if req.mfu else f", {mfu_source(req)})")
    console.print(
        "[dim]Vendor peak figures for memory, TFLOP/s and links; collective efficiency "
        f"({req.intra.efficiency:.0%} of {req.intra.label}) and {mfu} are assumptions; {OVERLAP}.[/]",
        highlight=False,
    )
