"""The decision tree's vocabulary: its steps, its answer, and the sentences that justify them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from distft.layout import SPECS
from distft.plan.estimate import Estimate, Request, estimate, parallelism_for
from distft.plan.hardware import format_bytes, format_seconds
from distft.plan.inputs import Parallelism

METHOD_NAMES = {"full": "Full finetuning", "lora": "LoRA", "qlora": "QLoRA"}
TIGHT = 0.9  # a fit above 90% of the usable memory is flagged: fragmentation can tip it over


@dataclass
class Step:
    question: str
    answer: str


@dataclass
class Recommendation:
    strategy: str | None  # None: nothing fits
    method: str
    activation_checkpointing: str  # the level (`Training.activation_checkpointing`)
    reason: str
    steps: list[Step]
    alternatives: list[str] = field(default_factory=list)
    parallelism: Parallelism | None = None

    @property
    def label(self) -> str:
        if not self.strategy:
            return "nothing fits"
        return SPECS[self.strategy].label if self.strategy in SPECS else "none"


gb = format_bytes  # a size in the tree's sentences


def fit_text(e: Estimate, req: Request) -> str:
    verdict = "fits" if e.fits else "does not fit"
    if e.fits and e.total > TIGHT * req.usable:
        verdict = f"fits, with under {1 - TIGHT:.0%} headroom"
    where = f"per GPU with {e.label}" if SPECS[e.strategy].distributed else "on one GPU"
    return f"{gb(e.total)} {where} ({verdict} in {gb(req.usable)} usable)"


def rate(e: Estimate) -> str:
    return f"~{e.tokens_per_s:,.0f} tokens/s estimated" if e.tokens_per_s else "no throughput estimate"


def others(est: dict[str, Estimate], *exclude: str, limit: int = 2) -> list[str]:
    """Other layouts that fit, fastest first, as alternatives (those distft cannot run say so)."""
    fitting = [
        e
        for e in est.values()
        if e.applicable and e.fits and e.strategy not in exclude and SPECS[e.strategy].distributed
    ]
    fitting.sort(key=lambda e: -(e.tokens_per_s or 0))
    return [
        f"{e.label} also fits: {gb(e.total)} per GPU, {rate(e)}"
        + ("." if e.runnable else " (not in distft).")
        for e in fitting[:limit]
    ]


def link_name(req: Request, e: Estimate) -> str:
    links = {c.link.label for c in e.collectives}
    return ", ".join(sorted(links)) if links else req.intra.label


def interconnect_slow(req: Request, fsdp: Estimate) -> tuple[bool, str]:
    """Slow: FSDP's traffic takes longer than the compute it should overlap with."""
    link = req.inter if req.nodes > 1 else req.intra
    compute = fsdp.compute_s
    kind = " (no NVLink)" if link.name.startswith("pcie") else ""
    traffic = (
        f"FSDP moves {gb(fsdp.comm_bytes)} per GPU per step over {link.label}{kind}, "
        f"about {format_seconds(fsdp.comm_s)}"
    )
    slow = bool(kind) if compute is None else fsdp.comm_s > compute
    if compute is None:
        why = " (no compute estimate for this GPU: judged by the link)"
    elif slow:
        why = f", more than the {format_seconds(compute)} of compute it should hide behind"
    else:
        why = f", less than the {format_seconds(compute)} of compute it hides behind"
    return slow, f"{'Yes' if slow else 'No'}: {traffic}{why}."


def inter_node_bytes(e: Estimate, req: Request) -> float:
    """Bytes on the wire per GPU per step over the inter-node link."""
    return sum(c.wire_bytes for c in e.collectives if c.link.name == req.inter.name)


def hsdp_reason(hsdp: Estimate, fsdp: Estimate, req: Request) -> str:
    """Why HSDP across nodes: what stays inside a node, what crosses, against FSDP over every GPU."""
    return (
        f"The job spans {req.nodes} nodes and {hsdp.label} fits ({gb(hsdp.total)} per GPU, {rate(hsdp)}): "
        f"FSDP's all-gathers and reduce-scatters stay inside each node on {req.intra.label}, and only an "
        f"all-reduce of 1/{hsdp.parallelism.shard_degree} of the gradients crosses {req.inter.label}, once per step: "
        f"{gb(inter_node_bytes(hsdp, req))} per GPU against {gb(inter_node_bytes(fsdp, req))} for FSDP over "
        f"all {req.world} GPUs ({gb(fsdp.total)} per GPU)."
    )


def fsdp_tp_reason(fsdp_tp: Estimate, fsdp: Estimate, req: Request) -> str:
    """Why FSDP x TP across nodes: TP on the node's links, FSDP across them, against FSDP alone."""
    than = (
        f"FSDP alone does not fit ({gb(fsdp.total)})"
        if not fsdp.fits
        else f"FSDP alone fits too ({gb(fsdp.total)}, {rate(fsdp)}) but needs a global batch of at least "
        f"{fsdp.min_global_batch} sequences, one per GPU, against {fsdp_tp.min_global_batch}"
    )
    return (
        f"The job spans {req.nodes} nodes: keep TP inside each node on {req.intra.label} and shard "
        f"with FSDP across nodes over {req.inter.label}: {fsdp_tp.label}, {gb(fsdp_tp.total)} per GPU, "
        f"{rate(fsdp_tp)}. {than}."
    )


def hsdp_tp_reason(hsdp_tp: Estimate, fsdp_tp: Estimate, req: Request) -> str:
    """Why HSDP x TP across nodes: FSDP x TP's layout with its gathers kept inside each node."""
    return (
        f"The job spans {req.nodes} nodes: TP inside each node on {req.intra.label}, FSDP across the "
        f"node's TP groups, and replicas across nodes over {req.inter.label}: {hsdp_tp.label}, "
        f"{gb(hsdp_tp.total)} per GPU, {rate(hsdp_tp)}. FSDP x TP fits at about that speed ({rate(fsdp_tp)}, "
        f"{gb(fsdp_tp.total)} per GPU) but gathers the weights across the nodes every micro-batch: "
        f"{gb(inter_node_bytes(fsdp_tp, req))} per GPU cross {req.inter.label} per step, against "
        f"{gb(inter_node_bytes(hsdp_tp, req))}."
    )


def hsdp_why_not(hsdp: Estimate) -> str:
    """Why not HSDP, when it applies (several nodes) but does not fit; else nothing."""
    if not hsdp.applicable or hsdp.fits:
        return ""
    return (
        f" HSDP would keep the gathers inside each node, but with 1/{hsdp.parallelism.shard_degree} of the model "
        f"per GPU it needs {gb(hsdp.total)}, which does not fit."
    )


def zero_across_nodes(req: Request, zero: Estimate, hsdp: Estimate) -> str:
    """Step 2's caveat across nodes: ZeRO-1/2 fit, but their all-reduce of every gradient (or their
    gathers) cross the inter-node link, and HSDP fits and is estimated more than 10% faster: the
    sentence that sends the tree on to sharding; empty otherwise."""
    if req.nodes < 2 or not zero.fits or not hsdp.fits:
        return ""
    if (hsdp.tokens_per_s or 0) <= 1.1 * (zero.tokens_per_s or 0):
        return ""
    return (
        f" But the job spans {req.nodes} nodes: {zero.label} moves {gb(inter_node_bytes(zero, req))} per GPU per "
        f"step over {req.inter.label} ({rate(zero)}), {hsdp.label} {gb(inter_node_bytes(hsdp, req))} "
        f"({rate(hsdp)}); see 3."
    )


def gpus_needed(req: Request) -> str:
    """The smallest number of these GPUs with which FSDP fits, as a sentence."""
    for n in (2, 4, 8, 16, 32, 64, 128, 256, 512):
        if n <= req.world:
            continue
        nodes = max(1, math.ceil(n / req.gpus_per_node))
        per_node = min(n, req.gpus_per_node)
        bigger = replace(req, gpus_per_node=per_node, nodes=nodes)
        e = estimate(bigger, parallelism_for(bigger, "fsdp", dp=per_node * nodes), "fsdp")
        if e.fits:
            return (
                f"{req.training.method.capitalize()} finetuning with FSDP fits from {per_node * nodes} such GPUs "
                f"({gb(e.total)} per GPU)."
            )
    return f"{req.training.method.capitalize()} finetuning does not fit with FSDP even on 512 such GPUs."


# Checkpointing levels that keep less than each one (selective is a lever the user picks, not one
# the walk tries: full and offload fit whatever selective fits).
STRONGER = {
    "none": ("full", "offload"),
    "selective": ("full", "offload"),
    "full": ("offload",),
    "offload": (),
}
KEEPS = {
    "full": "each layer keeps its input and is recomputed in backward, about a third more compute",
    "offload": "each layer's input waits in host memory and the layer is recomputed in backward: a third "
    "more compute and one copy out and back per layer, hidden behind long sequences' attention",
}


def experts_answer(req: Request, fsdp: Estimate, ep: Estimate) -> tuple[str, bool]:
    """3c. Do the experts need sharding? A mixture of experts under FSDP gathers every expert of a
    layer for each micro-batch though its tokens use k of them; expert parallelism keeps 1/N of
    the experts whole on each GPU and moves the routed tokens instead (`parallel/fsdp_ep.py`).
    The answer, and whether FSDP x EP is the pick (it fits, and FSDP does not or is slower)."""
    spec = req.model
    experts = sum(t.numel for t in spec.tensors() if t.kind == "experts") / spec.num_layers
    gathered = experts * req.training.precision.param
    routed = next((c for c in ep.collectives if c.kind == "all_to_all"), None)
    pick = ep.fits and (not fsdp.fits or (ep.tokens_per_s or 0) > (fsdp.tokens_per_s or 0))
    lay = ep.parallelism
    held = f"{spec.num_experts // lay.ep} experts " + (
        f"per GPU, FSDP-sharded across the {lay.dp // lay.ep} expert groups,"
        if lay.shard_experts
        else "whole per GPU"
    )
    moves = (
        f"FSDP gathers each layer's {spec.num_experts} experts ({gb(gathered)}) every micro-batch for the "
        f"{spec.num_experts_per_tok} each token uses; {ep.label} keeps {held} "
        f"and sends the routed tokens ({gb(routed.logical_bytes if routed else 0)} of "
        f"all-to-all per GPU per step, {format_seconds(routed.seconds if routed else 0)}, not overlapped)"
    )
    if not ep.fits:
        return f"No: {moves}, but {fit_text(ep, req)}.", False
    verdict = "Yes" if pick else "Not here"
    return (
        f"{verdict}: {moves}. {ep.label}: {fit_text(ep, req)}, {rate(ep)}; FSDP: {fit_text(fsdp, req)}, {rate(fsdp)}.",
        pick,
    )


METHODS = ("lora", "qlora")  # the adapter methods the tree weighs against full finetuning


def needs(e: Estimate) -> str:
    """What an adapter method needs on one GPU, or why it cannot run this model."""
    return f"{gb(e.total)} ({'fits' if e.fits else 'does not fit'})" if e.applicable else f"n/a ({e.note})"
