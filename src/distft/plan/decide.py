"""Every layout evaluated on the user's hardware, then the decision tree that picks one.

`evaluate` fills one `Estimate` per strategy: bytes per GPU by component (the worst rank: FSDP
rank 0 holds the largest chunk, pipeline stage 0 the most in-flight activations unless the last
stage's loss outweighs it), whether it fits in the GPU's memory minus a fixed overhead (CUDA
context, cuBLAS/NCCL workspaces, allocator slack: `Request.overhead`), bytes on the wire per
step and the time they take, and a rough step time. Two-dimensional layouts (FSDP x TP, DDP or
FSDP x PP) try every factorisation of the GPUs, TP inside a node and the pipeline across nodes,
and keep the one that fits with the shortest estimated step.

`decide` then walks the seeds' framework, question by question, and records each answer:
0. Can LoRA or QLoRA do it? (For full finetuning: would they fit, and where.)
1. Does it fit one GPU? Then memory is not the problem: one GPU, or DDP for throughput. If it
   fits only with activation checkpointing, that is the cheapest fix.
2. Is it the optimizer state? If weights, gradients and activations fit but AdamW's state does
   not, shard the optimizer state (ZeRO-1), then gradients (ZeRO-2).
3. Does the model need sharding? FSDP shards everything; across nodes FSDP x TP keeps TP on the
   node's fast links. Is the interconnect slow (PCIe, or FSDP's traffic longer than the compute it
   should hide behind)? TP+SP moves activations instead of weights.
4. Is sequence length the problem? FSDP does not split activations: TP+SP (or FSDP x TP) does;
   activation checkpointing trades them for a third more compute.
If nothing fits as asked, the tree says what would: checkpointing, LoRA/QLoRA, or more GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from distft.plan.hardware import GPU, GiB, Link, format_bytes, format_seconds
from distft.plan.memory import (
    Layout,
    Training,
    activation_bytes,
    comm_buffer_bytes,
    state_bytes,
    trainable_params,
)
from distft.plan.model_spec import ModelSpec
from distft.plan.traffic import (
    Collective,
    Topology,
    bubble_fraction,
    compute_seconds,
    step_collectives,
    step_flops,
    step_seconds,
)

METHOD_NAMES = {"full": "Full finetuning", "lora": "LoRA", "qlora": "QLoRA"}
TIGHT = 0.9  # a fit above 90% of the usable memory is flagged: fragmentation can tip it over

STRATEGIES = ("single", "ddp", "zero1", "zero2", "fsdp", "tp", "tp-sp", "pp", "fsdp+tp", "ddp+pp", "fsdp+pp")
IN_DISTFT = {"single", "ddp", "zero2", "fsdp", "tp", "tp-sp"}
LABELS = {
    "single": "one GPU",
    "ddp": "DDP",
    "zero1": "ZeRO-1",
    "zero2": "ZeRO-2 (FSDP2)",
    "fsdp": "FSDP / ZeRO-3",
    "tp": "TP",
    "tp-sp": "TP + SP",
    "pp": "PP",
    "fsdp+tp": "FSDP x TP+SP",
    "ddp+pp": "DDP x PP",
    "fsdp+pp": "FSDP x PP",
}


@dataclass(frozen=True)
class Request:
    """What the user asked: a model, how to train it, and the machines."""

    model: ModelSpec
    training: Training
    gpu: GPU
    gpu_memory: int
    gpus_per_node: int
    nodes: int
    intra: Link
    inter: Link
    grad_accum: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None  # default: max(grad_accum, 2 x stages)
    mfu: float = 0.4
    overhead: int = 1 * GiB

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def usable(self) -> int:
        return self.gpu_memory - self.overhead

    @property
    def topology(self) -> Topology:
        return Topology(self.gpus_per_node, self.nodes, self.intra, self.inter)


@dataclass
class Estimate:
    strategy: str
    layout: Layout
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    buffers: int = 0
    fits: bool = False
    applicable: bool = True
    note: str = ""
    stage: int = 0  # the pipeline stage the figures are for (the fullest)
    activation_detail: dict[str, int] = field(default_factory=dict)
    buffer_detail: dict[str, int] = field(default_factory=dict)
    collectives: list[Collective] = field(default_factory=list)
    compute_s: float | None = None
    step_s: float | None = None
    tokens_per_step: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    @property
    def label(self) -> str:
        lay = self.layout
        degrees = [f"{k}={v}" for k, v in (("dp", lay.dp), ("tp", lay.tp), ("pp", lay.pp)) if v > 1]
        return f"{LABELS[self.strategy]}" + (
            f" ({', '.join(degrees)})" if degrees and "+" in self.strategy else ""
        )

    @property
    def comm_bytes(self) -> float:
        return sum(c.wire_bytes for c in self.collectives)

    @property
    def comm_s(self) -> float:
        return sum(c.seconds for c in self.collectives)

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens_per_step / self.step_s if self.step_s else None

    @property
    def min_global_batch(self) -> int:
        """Sequences per optimizer step at the least: one micro-batch per data-parallel replica."""
        return self.layout.dp * self.layout.microbatches if self.layout.pp > 1 else self.layout.dp

    @property
    def in_distft(self) -> str:
        if self.strategy in IN_DISTFT:
            return "yes"
        return "pp branch" if self.strategy == "pp" else "no"


# ---------------------------------------------------------------------------------------------
# Evaluating layouts
# ---------------------------------------------------------------------------------------------


def _layout(req: Request, strategy: str, dp: int = 1, tp: int = 1, pp: int = 1) -> Layout:
    m = req.grad_accum
    if pp > 1:
        m = req.pp_microbatches or max(req.grad_accum, 2 * pp)
    common = {"microbatches": m, "schedule": req.pp_schedule}
    if strategy == "single":
        return Layout("single", **common)
    if strategy == "ddp" or strategy == "ddp+pp":
        return Layout(strategy, dp=dp, pp=pp, **common)
    if strategy == "zero1":
        return Layout(strategy, dp=dp, shard="optimizer", **common)
    if strategy == "zero2":
        return Layout(strategy, dp=dp, shard="full", reshard_after_forward=False, **common)
    if strategy in ("fsdp", "fsdp+pp"):
        return Layout(strategy, dp=dp, pp=pp, shard="full", **common)
    if strategy == "tp":
        return Layout(strategy, tp=tp, tp_impl="dtensor", **common)
    if strategy == "tp-sp":
        return Layout(strategy, tp=tp, sp=True, **common)
    if strategy == "fsdp+tp":
        return Layout(strategy, dp=dp, tp=tp, sp=True, shard="full", **common)
    if strategy == "pp":
        return Layout(strategy, pp=pp, **common)
    raise ValueError(strategy)


def _why_not(req: Request, layout: Layout) -> str:
    """Empty if the layout can run on this model and these GPUs, else the reason."""
    spec, tp = req.model, layout.tp
    if layout.world > req.world:
        return f"needs {layout.world} GPUs"
    if layout.world < 2 and layout.name != "single":
        return "needs 2+ GPUs"
    if tp > 1:
        if spec.num_heads % tp or spec.num_kv_heads % tp or spec.intermediate_size % tp:
            return f"TP degree {tp} must divide {spec.num_heads} query heads, {spec.num_kv_heads} KV heads and MLP {spec.intermediate_size}"
        if req.training.method == "qlora":
            return "QLoRA's NF4 weights are not split by distft's TP"
    if layout.pp > spec.num_layers:
        return f"more stages than the {spec.num_layers} layers"
    return ""


def estimate(req: Request, layout: Layout, strategy: str | None = None) -> Estimate:
    """Per-GPU memory of the fullest rank, traffic and time for one layout."""
    est = Estimate(strategy or layout.name, layout)
    why = _why_not(req, layout)
    if why:
        est.applicable, est.note = False, why
        return est
    worst = None
    for stage in range(layout.pp):
        state = state_bytes(req.model, req.training, layout, stage=stage)
        act = activation_bytes(req.model, req.training, layout, stage)
        buffers = comm_buffer_bytes(req.model, req.training, layout, stage)
        total = state.total + act.total + sum(buffers.values())
        if worst is None or total > worst[0]:
            worst = (total, stage, state, act, buffers)
    _, stage, state, act, buffers = worst
    est.stage = stage
    est.params, est.grads, est.optimizer = state.params, state.grads, state.optimizer
    est.activations, est.activation_detail = act.total, {**act.detail, "transient": act.transient}
    est.buffers, est.buffer_detail = sum(buffers.values()), buffers
    est.fits = est.total <= req.usable
    est.collectives = step_collectives(req.model, req.training, layout, req.topology)
    est.compute_s = compute_seconds(step_flops(req.model, req.training, layout), req.gpu.bf16_tflops, req.mfu)
    est.step_s = step_seconds(est.compute_s, est.collectives, layout)
    est.tokens_per_step = req.training.micro_batch * req.training.seq_len * layout.microbatches * layout.dp
    if layout.tp > req.gpus_per_node:
        est.note = "TP group spans nodes"
    return est


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def _best(candidates: list[Estimate]) -> Estimate | None:
    """Among fitting candidates, those within 10% of the best estimated throughput, then the one
    with the smallest global-batch floor (more TP, fewer replicas); if none fits, the smallest."""
    valid = [c for c in candidates if c.applicable]
    if not valid:
        return candidates[0] if candidates else None
    fitting = [c for c in valid if c.fits]
    if not fitting:
        return min(valid, key=lambda c: c.total)
    rates = [c.tokens_per_s for c in fitting if c.tokens_per_s]
    if rates:
        fitting = [c for c in fitting if c.tokens_per_s is None or c.tokens_per_s >= 0.9 * max(rates)]
    return min(fitting, key=lambda c: (c.min_global_batch, c.total))


def evaluate(req: Request) -> dict[str, Estimate]:
    """One estimate per strategy; 2-D layouts keep their best factorisation."""
    n, g = req.world, req.gpus_per_node
    out: dict[str, Estimate] = {}
    for strategy in STRATEGIES:
        if strategy in ("single",):
            layouts = [_layout(req, strategy)]
        elif strategy in ("ddp", "zero1", "zero2", "fsdp"):
            layouts = [_layout(req, strategy, dp=n)]
        elif strategy in ("tp", "tp-sp"):
            layouts = [_layout(req, strategy, tp=n)]
        elif strategy == "pp":
            layouts = [_layout(req, strategy, pp=n)]
        elif strategy == "fsdp+tp":  # TP inside a node, FSDP over the rest
            layouts = [_layout(req, strategy, dp=n // tp, tp=tp) for tp in _divisors(g) if n // tp >= 2]
        else:  # the pipeline outermost (across nodes when there are several)
            layouts = [_layout(req, strategy, dp=n // pp, pp=pp) for pp in _divisors(n) if n // pp >= 2]
        if not layouts:
            out[strategy] = Estimate(strategy, Layout(strategy), applicable=False, note="needs 4+ GPUs")
            continue
        est = _best([estimate(req, lay, strategy) for lay in layouts])
        if est is not None:
            out[strategy] = est
    return out


# ---------------------------------------------------------------------------------------------
# The decision tree
# ---------------------------------------------------------------------------------------------


@dataclass
class Step:
    question: str
    answer: str


@dataclass
class Recommendation:
    strategy: str | None  # None: nothing fits
    method: str
    activation_checkpointing: bool
    reason: str
    steps: list[Step]
    alternatives: list[str] = field(default_factory=list)
    layout: Layout | None = None

    @property
    def label(self) -> str:
        return LABELS.get(self.strategy, "none") if self.strategy else "nothing fits"


def _gb(n: float) -> str:
    return format_bytes(n)


def _fit_text(e: Estimate, req: Request) -> str:
    verdict = "fits" if e.fits else "does not fit"
    if e.fits and e.total > TIGHT * req.usable:
        verdict = f"fits, with under {1 - TIGHT:.0%} headroom"
    where = "on one GPU" if e.strategy == "single" else f"per GPU with {e.label}"
    return f"{_gb(e.total)} {where} ({verdict} in {_gb(req.usable)} usable)"


def _others(est: dict[str, Estimate], *exclude: str, limit: int = 2) -> list[str]:
    """Other layouts that fit, fastest first, as alternatives."""
    fitting = [e for e in est.values() if e.applicable and e.fits and e.strategy not in (*exclude, "single")]
    fitting.sort(key=lambda e: -(e.tokens_per_s or 0))
    return [f"{e.label} also fits: {_gb(e.total)} per GPU, {_rate(e)}." for e in fitting[:limit]]


def _command(req: Request, strategy: str, method: str, ckpt: bool) -> str | None:
    if strategy not in IN_DISTFT:
        return None
    parts = ["distft train", f"--model {req.model.name}", f"--method {method}", f"--strategy {strategy}"]
    if strategy != "single":
        parts.append(f"--nproc {req.gpus_per_node}")
        if req.nodes > 1:
            parts.append(f"--nnodes {req.nodes}")
    parts.append(f"data.max_length={req.training.seq_len}")
    if ckpt:
        parts.append("model.activation_checkpointing=true")
    return " ".join(parts)


def decide(req: Request, estimates: dict[str, Estimate] | None = None, depth: int = 0) -> Recommendation:
    """Walk the decision tree for `req` (see the module docstring)."""
    est = estimates or evaluate(req)
    t = req.training
    steps: list[Step] = []
    n = req.world
    single = est["single"]

    def rec(
        strategy: str | None, reason: str, ckpt: bool = t.activation_checkpointing, **kw
    ) -> Recommendation:
        alt = kw.pop("alternatives", [])
        return Recommendation(
            strategy, t.method, ckpt, reason, steps, alt, est[strategy].layout if strategy in est else None
        )

    # 0. LoRA / QLoRA
    if t.method == "full" and depth == 0:
        peft = {
            m: estimate(replace(req, training=replace(t, method=m)), _layout(req, "single"))
            for m in ("lora", "qlora")
        }
        steps.append(
            Step(
                "0. Can LoRA or QLoRA do it?",
                f"On one GPU LoRA needs {_gb(peft['lora'].total)} ({'fits' if peft['lora'].fits else 'does not fit'}), "
                f"QLoRA {_gb(peft['qlora'].total)} ({'fits' if peft['qlora'].fits else 'does not fit'}), against "
                f"{_gb(single.total)} for full finetuning. If adapters are enough for the task, they are the cheaper "
                "answer; the rest of the tree plans full finetuning as asked.",
            )
        )
    elif depth == 0:
        trained = trainable_params(req.model, t)
        steps.append(
            Step(
                "0. Can LoRA or QLoRA do it?",
                f"{METHOD_NAMES[t.method]} is the plan: {trained / 1e6:.1f}M adapter parameters train; the "
                f"{req.model.num_params() / 1e9:.2f}B base is frozen"
                + (" in 4-bit NF4" if t.method == "qlora" else "")
                + ", so gradients and optimizer state cover the adapters only.",
            )
        )

    # 1. One GPU?
    if single.fits:
        steps.append(Step("1. Does it fit on one GPU?", f"Yes: {_fit_text(single, req)}."))
        if n == 1:
            return rec(
                "single",
                f"It fits on one GPU ({_gb(single.total)} of {_gb(req.usable)}); nothing to distribute.",
            )
        ddp = est["ddp"]
        comm = ddp.comm_s
        share = f"; compute about {format_seconds(ddp.compute_s)}" if ddp.compute_s else ""
        return rec(
            "ddp",
            f"The model fits on one GPU, so memory is not the problem: add GPUs for throughput with DDP. Each "
            f"of the {n} GPUs holds a full replica ({_gb(ddp.total)}) and all-reduces "
            f"{_gb(sum(c.logical_bytes for c in ddp.collectives))} of gradients per step over {_link_name(req, ddp)} "
            f"(about {format_seconds(comm)}, overlapping backward{share}).",
        )
    ckpt_single = None
    if not t.activation_checkpointing:
        ckpt_req = replace(req, training=replace(t, activation_checkpointing=True))
        ckpt_single = estimate(ckpt_req, _layout(req, "single"))
    if ckpt_single is not None and ckpt_single.fits:
        steps.append(
            Step(
                "1. Does it fit on one GPU?",
                f"Not as asked ({_gb(single.total)}, {_gb(single.activations)} of it activations), but with "
                f"activation checkpointing it needs {_gb(ckpt_single.total)}, which fits.",
            )
        )
        strategy = "single" if n == 1 else "ddp"
        return rec(
            strategy,
            "Activations are what does not fit: turn on activation checkpointing (each layer keeps its input "
            "and is recomputed in backward, about a third more compute), then "
            + ("train on the one GPU." if n == 1 else f"use DDP over the {n} GPUs for throughput."),
            ckpt=True,
        )
    steps.append(Step("1. Does it fit on one GPU?", f"No: {_fit_text(single, req)}."))
    if n == 1:
        return _nothing_fits(req, est, steps, depth)

    # 2. The optimizer state?
    without_opt = single.total - single.optimizer
    if without_opt <= req.usable and single.optimizer > 0:
        zero1, zero2 = est["zero1"], est["zero2"]
        steps.append(
            Step(
                "2. Is it the optimizer state?",
                f"Yes: without AdamW's state ({_gb(single.optimizer)}) one GPU would need {_gb(without_opt)}. "
                f"ZeRO-1 shards it ({_gb(zero1.total)} per GPU), ZeRO-2 also the gradients ({_gb(zero2.total)} with "
                "distft's FSDP2 version, which keeps the gathered weights from forward to backward).",
            )
        )
        if zero1.fits:
            alt = [
                f"distft has no ZeRO-1; its zero2 {'also fits' if zero2.fits else 'does not fit'} ({_gb(zero2.total)}).",
                *_others(est, "zero1", "zero2", limit=1),
            ]
            return rec(
                "zero1",
                f"Weights, gradients and activations fit; only the optimizer state does not. ZeRO-1 shards it "
                f"over {n} GPUs ({_gb(zero1.total)} per GPU) for the same traffic as DDP.",
                alternatives=alt,
            )
        if zero2.fits:
            return rec(
                "zero2",
                f"Sharding the optimizer state alone is not enough ({_gb(zero1.total)}); ZeRO-2 shards gradients too "
                f"and fits ({_gb(zero2.total)} per GPU).",
                alternatives=_others(est, "zero2"),
            )
    else:
        steps.append(
            Step(
                "2. Is it the optimizer state?",
                f"No: even without AdamW's state ({_gb(single.optimizer)}) one GPU would need {_gb(without_opt)}.",
            )
        )

    # 3. Sharding, interconnect, 4. sequence length
    return _shard(req, est, steps, depth)


def _link_name(req: Request, e: Estimate) -> str:
    links = {c.link.label for c in e.collectives}
    return ", ".join(sorted(links)) if links else req.intra.label


def _shard(req: Request, est: dict[str, Estimate], steps: list[Step], depth: int) -> Recommendation:
    t = req.training
    fsdp, tpsp, fsdp_tp = est["fsdp"], est["tp-sp"], est["fsdp+tp"]
    pp_family = [est[s] for s in ("fsdp+pp", "ddp+pp", "pp") if est[s].applicable]

    def rec(strategy: str, reason: str, alternatives: list[str] | None = None) -> Recommendation:
        others = [*(alternatives or []), *_others(est, strategy)]
        return Recommendation(
            strategy, t.method, t.activation_checkpointing, reason, steps, others, est[strategy].layout
        )

    fsdp_state = fsdp.total - fsdp.activations
    steps.append(
        Step(
            "3. Does the model need sharding?",
            f"Yes: {_fit_text(fsdp, req)}"
            + ("" if fsdp.fits else f"; without activations it would need {_gb(fsdp_state)}")
            + ".",
        )
    )
    slow, why_slow = _interconnect_slow(req, fsdp)
    steps.append(Step("3b. Is the interconnect slow?", why_slow))
    seq_problem = not fsdp.fits and fsdp_state <= req.usable
    steps.append(
        Step(
            "4. Is sequence length the problem?",
            (
                f"Yes: FSDP shards the weights but every GPU keeps the activations of its own sequences "
                f"({_gb(fsdp.activations)} at {t.seq_len} tokens x {t.micro_batch}); TP+SP splits them"
                f" ({_gb(tpsp.activations) if tpsp.applicable else 'n/a'} per GPU with TP+SP)."
            )
            if seq_problem
            else f"No: activations are {_gb(fsdp.activations)} of FSDP's {_gb(fsdp.total)} per GPU.",
        )
    )
    ckpt_note = []
    if not t.activation_checkpointing:
        ckpt = estimate(replace(req, training=replace(t, activation_checkpointing=True)), fsdp.layout, "fsdp")
        if ckpt.applicable and ckpt.fits and not fsdp.fits:
            ckpt_note = [
                f"Or keep plain FSDP and turn on activation checkpointing: {_gb(ckpt.total)} per GPU, about a "
                "third more compute."
            ]

    if req.nodes > 1:  # FSDP everywhere, FSDP x TP (TP inside nodes), or a pipeline across nodes
        best = _best([e for e in (fsdp, fsdp_tp, *pp_family) if e.applicable and e.fits])
        if best is None or not best.fits:
            return _nothing_fits(req, est, steps, depth)
        if best.strategy == "fsdp+tp":
            than = (
                f"FSDP alone does not fit ({_gb(fsdp.total)})"
                if not fsdp.fits
                else f"FSDP alone fits too ({_gb(fsdp.total)}, {_rate(fsdp)}) but needs a global batch of at least "
                f"{fsdp.min_global_batch} sequences, one per GPU, against {fsdp_tp.min_global_batch}"
            )
            reason = (
                f"The job spans {req.nodes} nodes: keep TP (with SP) inside each node on {req.intra.label} and shard "
                f"with FSDP across nodes over {req.inter.label}: {fsdp_tp.label}, {_gb(fsdp_tp.total)} per GPU, "
                f"{_rate(fsdp_tp)}. {than}."
            )
        elif best.strategy == "fsdp":
            reason = (
                f"FSDP over all {req.world} GPUs fits ({_gb(fsdp.total)} per GPU, {_rate(fsdp)}); its traffic across "
                f"nodes ({format_seconds(fsdp.comm_s)} per step) hides behind compute."
            )
        else:
            lay = best.layout
            inner = "FSDP" if lay.shard == "full" else "DDP"
            reason = (
                f"Across nodes a pipeline needs only point-to-point sends at stage boundaries over {req.inter.label}, "
                f"while {inner} stays on {req.intra.label} inside each node: {_fit_text(best, req)}, {_rate(best)}. "
                f"It needs a global batch of at least {best.min_global_batch} sequences ({lay.dp} replicas x "
                f"{lay.microbatches} micro-batches, {lay.schedule}) to keep the bubble at {bubble_fraction(lay):.0%}."
            )
        return rec(best.strategy, reason, ckpt_note)

    if fsdp.fits:
        if slow and tpsp.fits and (tpsp.tokens_per_s or 0) > (fsdp.tokens_per_s or 0):
            return rec(
                "tp-sp",
                f"The model needs sharding and {req.intra.label} is slow for FSDP, which moves the weights every "
                f"micro-batch ({_gb(fsdp.comm_bytes)} per GPU per step, {format_seconds(fsdp.comm_s)}); TP+SP moves "
                f"activations instead ({_gb(tpsp.comm_bytes)}, {format_seconds(tpsp.comm_s)}), fits "
                f"({_gb(tpsp.total)} per GPU) and is faster ({_rate(tpsp)} against {_rate(fsdp)}).",
            )
        hides = (
            "hides behind compute"
            if not slow
            else "does not fully hide behind compute, but FSDP is still faster"
        )
        return rec(
            "fsdp",
            f"The model needs sharding; FSDP shards weights, gradients and optimizer state over {req.world} GPUs "
            f"({_gb(fsdp.total)} per GPU) and its traffic ({format_seconds(fsdp.comm_s)} per step on "
            f"{req.intra.label}) {hides} ({_rate(fsdp)}).",
        )
    if seq_problem:
        for cand in (fsdp_tp, tpsp) if not slow else (tpsp, fsdp_tp):
            if cand.fits:
                return rec(
                    cand.strategy,
                    f"FSDP alone does not fit because of activations ({_gb(fsdp.activations)} per GPU at "
                    f"{t.seq_len} tokens); {cand.label} splits them with sequence parallelism and shards the weights: "
                    f"{_gb(cand.total)} per GPU.",
                    ckpt_note,
                )
    for cand in (tpsp, fsdp_tp, *pp_family):
        if cand.applicable and cand.fits:
            return rec(cand.strategy, f"{_fit_text(cand, req)}.", ckpt_note)
    if ckpt_note:
        return Recommendation(
            "fsdp", t.method, True, ckpt_note[0].replace("Or keep", "Keep"), steps, [], fsdp.layout
        )
    return _nothing_fits(req, est, steps, depth)


def _rate(e: Estimate) -> str:
    return f"~{e.tokens_per_s:,.0f} tokens/s estimated" if e.tokens_per_s else "no throughput estimate"


def _interconnect_slow(req: Request, fsdp: Estimate) -> tuple[bool, str]:
    """Slow: FSDP's traffic takes longer than the compute it should overlap with."""
    link = req.inter if req.nodes > 1 else req.intra
    compute = fsdp.compute_s
    kind = " (no NVLink)" if link.name.startswith("pcie") else ""
    traffic = (
        f"FSDP moves {_gb(fsdp.comm_bytes)} per GPU per step over {link.label}{kind}, "
        f"about {format_seconds(fsdp.comm_s)}"
    )
    if compute is None:
        slow = bool(kind)
        return (
            slow,
            f"{'Yes' if slow else 'No'}: {traffic} (no compute estimate for this GPU: judged by the link).",
        )
    if fsdp.comm_s > compute:
        return (
            True,
            f"Yes: {traffic}, more than the {format_seconds(compute)} of compute it should hide behind.",
        )
    return False, f"No: {traffic}, less than the {format_seconds(compute)} of compute it hides behind."


def _nothing_fits(req: Request, est: dict[str, Estimate], steps: list[Step], depth: int) -> Recommendation:
    """Nothing fits as asked: say what would (checkpointing, LoRA/QLoRA, more GPUs)."""
    t = req.training
    smallest = min((e for e in est.values() if e.applicable), key=lambda e: e.total)
    what = f"Nothing fits as asked: the smallest is {smallest.label} at {_gb(smallest.total)} per GPU."
    steps.append(Step("Result", what))
    alternatives = []
    if depth == 0 and not t.activation_checkpointing:
        ckpt = decide(replace(req, training=replace(t, activation_checkpointing=True)), depth=1)
        if ckpt.strategy:
            return Recommendation(
                ckpt.strategy, t.method, True,
                f"{what} With activation checkpointing {ckpt.label} fits: {ckpt.reason}",
                steps, ckpt.alternatives, ckpt.layout,
            )  # fmt: skip
    if depth == 0 and t.method == "full":
        # Prefer an adapter method that fits on one GPU (then DDP adds throughput): LoRA, else QLoRA;
        # failing both, LoRA with whatever sharding it needs.
        options = {m: decide(replace(req, training=replace(t, method=m)), depth=1) for m in ("lora", "qlora")}
        unsharded = [m for m, r in options.items() if r.strategy in ("single", "ddp")]
        fitting = [m for m, r in options.items() if r.strategy]
        if unsharded or fitting:
            method = (unsharded or fitting)[0]
            r = options[method]
            return Recommendation(
                r.strategy, method, r.activation_checkpointing,
                f"{what} Full finetuning needs more memory than these GPUs offer; {METHOD_NAMES[method]} fits with "
                f"{r.label}: {r.reason}",
                steps, [_gpus_needed(req)], r.layout,
            )  # fmt: skip
    if depth == 0 and t.method == "lora":
        r = decide(replace(req, training=replace(t, method="qlora")), depth=1)
        if r.strategy:
            return Recommendation(
                r.strategy, "qlora", r.activation_checkpointing, f"{what} QLoRA fits with {r.label}: {r.reason}",
                steps, [], r.layout,
            )  # fmt: skip
    return Recommendation(
        None, t.method, t.activation_checkpointing, what + " " + _gpus_needed(req), steps, alternatives
    )


def _gpus_needed(req: Request) -> str:
    """The smallest number of these GPUs with which FSDP fits, as a sentence."""
    for n in (2, 4, 8, 16, 32, 64, 128, 256, 512):
        if n <= req.world:
            continue
        nodes = max(1, math.ceil(n / req.gpus_per_node))
        per_node = min(n, req.gpus_per_node)
        bigger = replace(req, gpus_per_node=per_node, nodes=nodes)
        e = estimate(bigger, _layout(bigger, "fsdp", dp=per_node * nodes), "fsdp")
        if e.fits:
            return (
                f"{req.training.method.capitalize()} finetuning with FSDP fits from {per_node * nodes} such GPUs "
                f"({_gb(e.total)} per GPU)."
            )
    return f"{req.training.method.capitalize()} finetuning does not fit with FSDP even on 512 such GPUs."
