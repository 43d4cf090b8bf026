"""The decision tree: from the estimates of every layout (`estimate.evaluate`) to one recommendation.

`decide` walks the blog series' framework, question by question, and records each answer:
0. Can LoRA or QLoRA do it? (For full finetuning: would they fit, and where.)
1. Does it fit one GPU? Then memory is not the problem: one GPU, or DDP for throughput. If it
   fits only with activation checkpointing (full, else offload), that is the cheapest fix.
2. Is it the optimizer state? If weights, gradients and activations fit but AdamW's state does
   not, shard the optimizer state (ZeRO-1), then gradients (ZeRO-2).
3. Does the model need sharding? FSDP shards everything; across nodes HSDP keeps FSDP's gathers
   inside each node and FSDP x TP keeps TP on the node's fast links. Is the interconnect slow (PCIe,
   or FSDP's traffic longer than the compute it should hide behind)? TP+SP moves activations
   instead of weights. A mixture of experts: FSDP x EP keeps the experts whole and moves tokens.
4. Is sequence length the problem? FSDP does not split activations: CP splits the positions (FSDP
   x CP also shards the weights: in CP's place where as fast, or where neither TP split fits), TP+SP
   does too, FSDP x TP splits attention's and the MLP's over its TP ranks; activation checkpointing
   trades them for a third more compute.
If nothing fits as asked, the tree says what would: checkpointing, LoRA/QLoRA, or more GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from distft.layout import SPECS
from distft.plan.estimate import Estimate, Request, best, estimate, evaluate, parallelism_for
from distft.plan.explain import (
    KEEPS,
    METHOD_NAMES,
    METHODS,
    STRONGER,
    Recommendation,
    Step,
    experts_answer,
    fit_text,
    fsdp_tp_reason,
    gb,
    gpus_needed,
    hsdp_reason,
    hsdp_tp_reason,
    hsdp_why_not,
    interconnect_slow,
    link_name,
    needs,
    others,
    rate,
    zero_across_nodes,
)
from distft.plan.hardware import format_seconds
from distft.plan.memory import trainable_params


@dataclass
class _Walk:
    """One walk down the tree: the request, every estimate, the answers so far."""

    req: Request
    est: dict[str, Estimate]
    depth: int
    steps: list[Step] = field(default_factory=list)

    def ask(self, question: str, answer: str) -> None:
        self.steps.append(Step(question, answer))

    def rec(self, strategy: str, reason: str, alternatives: list[str] | None = None, ckpt: str | None = None):
        t = self.req.training
        ckpt = t.activation_checkpointing if ckpt is None else ckpt
        return Recommendation(
            strategy, t.method, ckpt, reason, self.steps, alternatives or [], self.est[strategy].parallelism
        )

    def with_training(self, **changes) -> Request:
        return replace(self.req, training=replace(self.req.training, **changes))


def decide(req: Request, estimates: dict[str, Estimate] | None = None, depth: int = 0) -> Recommendation:
    """Walk the decision tree for `req` (see the module docstring)."""
    walk = _Walk(req, estimates or evaluate(req), depth)
    if depth == 0:
        _adapters(walk)
    return _one_gpu(walk) or _optimizer_state(walk) or _shard(walk)


def _adapters(walk: _Walk) -> None:
    """0. Can LoRA or QLoRA do it?"""
    req, t, single = walk.req, walk.req.training, walk.est["single"]
    if t.method == "full":
        single_gpu = parallelism_for(req, "single")
        lora, qlora = (estimate(walk.with_training(method=m), single_gpu) for m in METHODS)
        walk.ask(
            "0. Can LoRA or QLoRA do it?",
            f"On one GPU LoRA needs {needs(lora)}, QLoRA {needs(qlora)}, against {gb(single.total)} for full "
            "finetuning. If adapters are enough for the task, they are the cheaper answer; the rest of the "
            "tree plans full finetuning as asked.",
        )
        return
    trained = trainable_params(req.model, t)
    walk.ask(
        "0. Can LoRA or QLoRA do it?",
        f"{METHOD_NAMES[t.method]} is the plan: {trained / 1e6:.1f}M adapter parameters train; the "
        f"{req.model.num_params() / 1e9:.2f}B base is frozen{' in 4-bit NF4' if t.method == 'qlora' else ''}, "
        "so gradients and optimizer state cover the adapters only.",
    )


def _one_gpu(walk: _Walk) -> Recommendation | None:
    """1. Does it fit on one GPU? (As asked, or with activation checkpointing.)"""
    req, t, single, n = walk.req, walk.req.training, walk.est["single"], walk.req.world
    question = "1. Does it fit on one GPU?"
    if single.fits:
        walk.ask(question, f"Yes: {fit_text(single, req)}.")
        if n == 1:
            return walk.rec(
                "single",
                f"It fits on one GPU ({gb(single.total)} of {gb(req.usable)}); nothing to distribute.",
            )
        ddp = walk.est["ddp"]
        share = f"; compute about {format_seconds(ddp.compute_s)}" if ddp.compute_s else ""
        return walk.rec(
            "ddp",
            f"The model fits on one GPU, so memory is not the problem: add GPUs for throughput with DDP. Each "
            f"of the {n} GPUs holds a full replica ({gb(ddp.total)}) and all-reduces "
            f"{gb(sum(c.logical_bytes for c in ddp.collectives))} of gradients per step over {link_name(req, ddp)} "
            f"(about {format_seconds(ddp.comm_s)}, overlapping backward{share}).",
        )
    for level in STRONGER[t.activation_checkpointing]:  # full, then offload: what each layer keeps
        ckpt = estimate(walk.with_training(activation_checkpointing=level), parallelism_for(req, "single"))
        if ckpt.fits:
            walk.ask(
                question,
                f"Not as asked ({gb(single.total)}, {gb(single.activations)} of it activations), but with "
                f"activation checkpointing ({level}) it needs {gb(ckpt.total)}, which fits.",
            )
            return walk.rec(
                "single" if n == 1 else "ddp",
                f"Activations are what does not fit: model.activation_checkpointing={level} ({KEEPS[level]}), then "
                + ("train on the one GPU." if n == 1 else f"use DDP over the {n} GPUs for throughput."),
                ckpt=level,
            )
    walk.ask(question, f"No: {fit_text(single, req)}.")
    return _nothing_fits(walk) if n == 1 else None


def _optimizer_state(walk: _Walk) -> Recommendation | None:
    """2. Is it the optimizer state? ZeRO-1 shards it, ZeRO-2 the gradients too."""
    req, est, single, n = walk.req, walk.est, walk.est["single"], walk.req.world
    question = "2. Is it the optimizer state?"
    without_opt = single.total - single.optimizer
    if without_opt > req.usable or single.optimizer == 0:
        walk.ask(
            question,
            f"No: even without AdamW's state ({gb(single.optimizer)}) one GPU would need {gb(without_opt)}.",
        )
        return None
    zero1, zero2 = est["zero1"], est["zero2"]
    walk.ask(
        question,
        f"Yes: without AdamW's state ({gb(single.optimizer)}) one GPU would need {gb(without_opt)}. "
        f"ZeRO-1 shards it ({gb(zero1.total)} per GPU), ZeRO-2 also the gradients ({gb(zero2.total)} with "
        "distft's FSDP2 version, which keeps the gathered weights from forward to backward).",
    )
    slower = zero_across_nodes(req, zero1 if zero1.fits else zero2, est["hsdp"])
    if slower:  # across nodes ZeRO all-reduces every gradient over the slow link: shard instead
        walk.steps[-1].answer += slower
        return None
    if zero1.fits:
        return walk.rec(
            "zero1",
            f"Weights, gradients and activations fit; only the optimizer state does not. ZeRO-1 shards it "
            f"over {n} GPUs ({gb(zero1.total)} per GPU), keeping DDP's gradient all-reduce and adding one "
            "broadcast of the updated weights per step.",
            others(est, "zero1", limit=2),
        )
    if zero2.fits:
        return walk.rec(
            "zero2",
            f"Sharding the optimizer state alone is not enough ({gb(zero1.total)}); ZeRO-2 shards gradients too "
            f"and fits ({gb(zero2.total)} per GPU).",
            others(est, "zero2"),
        )
    return None


def _shard(walk: _Walk) -> Recommendation:
    """3. Does the model need sharding, and is the interconnect slow? 4. Is sequence length the problem?"""
    req, t, fsdp, tpsp = walk.req, walk.req.training, walk.est["fsdp"], walk.est["tp-sp"]
    fsdp_state = fsdp.total - fsdp.activations
    without = "" if fsdp.fits else f"; without activations it would need {gb(fsdp_state)}"
    walk.ask("3. Does the model need sharding?", f"Yes: {fit_text(fsdp, req)}{without}.")
    ep = next(e for name, e in walk.est.items() if SPECS[name].expert_groups)  # fsdp+ep
    if ep.applicable:  # a mixture of experts: shard the experts whole instead of gathering them
        answer, pick = experts_answer(req, fsdp, ep)
        walk.ask("3a. Do the experts need sharding?", answer)
        if pick:
            return walk.rec(ep.strategy, answer.split(": ", 1)[1], others(walk.est, ep.strategy))
    slow, why_slow = interconnect_slow(req, fsdp)
    walk.ask("3b. Is the interconnect slow?", why_slow)
    seq_problem = not fsdp.fits and fsdp_state <= req.usable
    walk.ask(
        "4. Is sequence length the problem?",
        (
            f"Yes: FSDP shards the weights but every GPU keeps the activations of its own sequences "
            f"({gb(fsdp.activations)} at {t.seq_len} tokens x {t.micro_batch}); TP+SP splits them"
            f" ({gb(tpsp.activations) if tpsp.applicable else 'n/a'} per GPU with TP+SP)."
        )
        if seq_problem
        else f"No: activations are {gb(fsdp.activations)} of FSDP's {gb(fsdp.total)} per GPU.",
    )
    ckpt_note = []
    if not t.checkpointed:
        ckpt = estimate(walk.with_training(activation_checkpointing="full"), fsdp.parallelism, "fsdp")
        if ckpt.applicable and ckpt.fits and not fsdp.fits:
            ckpt_note = [
                f"Or keep plain FSDP and turn on activation checkpointing: {gb(ckpt.total)} per GPU, about a "
                "third more compute."
            ]
    if req.nodes > 1:
        return _across_nodes(walk, ckpt_note)
    return _one_node(walk, slow, seq_problem, ckpt_note)


def _pipelines(walk: _Walk) -> list[Estimate]:  # the most dimensions first
    return [walk.est[s] for s, c in reversed(SPECS.items()) if c.pipelined and walk.est[s].applicable]


def _across_nodes(walk: _Walk, ckpt_note: list[str]) -> Recommendation:
    """FSDP everywhere, HSDP (FSDP inside nodes), FSDP x TP (TP inside nodes), HSDP x TP, or a
    pipeline across nodes: the best that fits. HSDP over FSDP (and HSDP x TP over FSDP x TP)
    whenever it fits at about the other's estimated speed: the estimate lets FSDP's inter-node
    traffic hide behind compute, but that traffic is the one a shared, ten times slower fabric
    delays, and HSDP sends a fraction of it across."""
    req, est = walk.req, walk.est
    fsdp, hsdp, fsdp_tp, hsdp_tp = est["fsdp"], est["hsdp"], est["fsdp+tp"], est["hsdp+tp"]
    pick = best([e for e in (fsdp, hsdp, fsdp_tp, *_pipelines(walk)) if e.applicable and e.fits])
    if pick is None or not pick.fits:
        return _nothing_fits(walk)
    # An HSDP layout in place of its FSDP one wherever it fits at about its speed (one that does
    # not apply never fits): the same layout, the gathers kept off the slower fabric.
    for flat, hybrid in ((fsdp, hsdp), (fsdp_tp, hsdp_tp)):
        if pick is flat and hybrid.fits and (hybrid.tokens_per_s or 0) >= 0.9 * (flat.tokens_per_s or 0):
            pick = hybrid
    if pick.strategy == "fsdp+tp":
        reason = fsdp_tp_reason(fsdp_tp, fsdp, req)
    elif pick.strategy == "hsdp+tp":
        reason = hsdp_tp_reason(hsdp_tp, fsdp_tp, req)
    elif pick.strategy == "hsdp":
        reason = hsdp_reason(hsdp, fsdp, req)
    elif pick.strategy == "fsdp":
        reason = (
            f"FSDP over all {req.world} GPUs fits ({gb(fsdp.total)} per GPU, {rate(fsdp)}); its traffic across "
            f"nodes ({format_seconds(fsdp.comm_s)} per step) hides behind compute.{hsdp_why_not(hsdp)}"
        )
    else:
        lay = pick.parallelism
        inner = ("FSDP x TP" if lay.tp > 1 else "FSDP") if lay.shard == "full" else "DDP"
        reason = (
            f"Across nodes a pipeline needs only point-to-point sends at stage boundaries over {req.inter.label}, "
            f"while {inner} stays on {req.intra.label} inside each node: {fit_text(pick, req)}, {rate(pick)}. "
            f"It needs a global batch of at least {pick.min_global_batch} sequences ({lay.dp} replicas x "
            f"{lay.microbatches} micro-batches, {lay.schedule}) to keep the idle share at {lay.idle_fraction():.0%}."
        )
    return walk.rec(pick.strategy, reason, [*ckpt_note, *others(est, pick.strategy)])


def _one_node(walk: _Walk, slow: bool, seq_problem: bool, ckpt_note: list[str]) -> Recommendation:
    """One node: FSDP unless the link is slow (TP+SP) or activations do not fit (TP+SP, FSDP x TP)."""
    req, est, t = walk.req, walk.est, walk.req.training
    fsdp, tpsp, fsdp_tp = est["fsdp"], est["tp-sp"], est["fsdp+tp"]

    def rec(strategy: str, reason: str, alternatives: list[str] | None = None) -> Recommendation:
        return walk.rec(strategy, reason, [*(alternatives or []), *others(est, strategy)])

    if fsdp.fits:
        if slow and tpsp.fits and (tpsp.tokens_per_s or 0) > (fsdp.tokens_per_s or 0):
            return rec(
                "tp-sp",
                f"The model needs sharding and {req.intra.label} is slow for FSDP, which moves the weights every "
                f"micro-batch ({gb(fsdp.comm_bytes)} per GPU per step, {format_seconds(fsdp.comm_s)}); TP+SP moves "
                f"activations instead ({gb(tpsp.comm_bytes)}, {format_seconds(tpsp.comm_s)}), fits "
                f"({gb(tpsp.total)} per GPU) and is faster ({rate(tpsp)} against {rate(fsdp)}).",
            )
        hides = "is not all hidden by compute, but FSDP is still faster" if slow else "hides behind compute"
        return rec(
            "fsdp",
            f"The model needs sharding; FSDP shards weights, gradients and optimizer state over {req.world} GPUs "
            f"({gb(fsdp.total)} per GPU) and its traffic ({format_seconds(fsdp.comm_s)} per step on "
            f"{req.intra.label}) {hides} ({rate(fsdp)}).",
        )
    if seq_problem:
        order, cp, fsdp_cp = (fsdp_tp, tpsp) if not slow else (tpsp, fsdp_tp), est["cp"], est["fsdp+cp"]
        # CP first where its whole weights fit and it is fastest, FSDP x CP in its place where as fast
        # in less memory (`best`); FSDP x CP next where neither TP split holds the activations.
        top, contexts = max((c.tokens_per_s or 0 for c in order if c.fits), default=0), [cp, fsdp_cp]
        first = [best([c for c in contexts if c.fits])] if cp.fits and (cp.tokens_per_s or 0) >= top else []
        for cand in (*first, *order, fsdp_cp, cp):
            if cand.fits:
                return rec(
                    cand.strategy,
                    f"FSDP alone does not fit because of activations ({gb(fsdp.activations)} per GPU at "
                    f"{t.seq_len} tokens); {cand.label} {SPECS[cand.strategy].splits_activations}: {gb(cand.total)} per GPU.",
                    ckpt_note,
                )
    for cand in (tpsp, fsdp_tp, *_pipelines(walk)):
        if cand.applicable and cand.fits:
            return rec(cand.strategy, f"{fit_text(cand, req)}.", ckpt_note)
    if ckpt_note:
        keep = ckpt_note[0].replace("Or keep", "Keep")
        return Recommendation("fsdp", t.method, "full", keep, walk.steps, [], fsdp.parallelism)
    return _nothing_fits(walk)


def _nothing_fits(walk: _Walk) -> Recommendation:
    """Nothing fits as asked: say what would (checkpointing, LoRA/QLoRA, more GPUs)."""
    req, t, steps = walk.req, walk.req.training, walk.steps
    smallest = min((e for e in walk.est.values() if e.applicable), key=lambda e: e.total, default=None)
    what = f"No layout runs {METHOD_NAMES[t.method]} on {req.model.name}."  # QLoRA of a mixture of experts
    if smallest:
        what = f"Nothing fits as asked: the smallest is {smallest.label} at {gb(smallest.total)} per GPU."
    walk.ask("Result", what)
    if walk.depth == 0 and not t.checkpointed:
        r = decide(walk.with_training(activation_checkpointing="full"), depth=1)
        if r.strategy:
            reason = f"{what} With activation checkpointing {r.label} fits: {r.reason}"
            return replace(r, reason=reason, steps=steps)  # its checkpointing level, not a flag
    if walk.depth == 0 and t.method == "full":
        # Prefer an adapter method that fits on one GPU (then DDP adds throughput): LoRA, else QLoRA;
        # failing both, LoRA with whatever sharding it needs.
        options = {m: decide(walk.with_training(method=m), depth=1) for m in ("lora", "qlora")}
        unsharded = [m for m, r in options.items() if r.strategy in ("single", "ddp")]
        fitting = [m for m, r in options.items() if r.strategy]
        if unsharded or fitting:
            method = (unsharded or fitting)[0]
            r = options[method]
            reason = (
                f"{what} Full finetuning needs more memory than these GPUs offer; {METHOD_NAMES[method]} fits with "
                f"{r.label}: {r.reason}"
            )
            return replace(r, reason=reason, steps=steps, alternatives=[gpus_needed(req)])
    if walk.depth == 0 and t.method == "lora":
        r = decide(walk.with_training(method="qlora"), depth=1)
        if r.strategy:
            reason = f"{what} QLoRA fits with {r.label}: {r.reason}"
            return replace(r, reason=reason, steps=steps, alternatives=[])
    return Recommendation(
        None, t.method, t.activation_checkpointing, what + " " + gpus_needed(req), steps, []
    )
