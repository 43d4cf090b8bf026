"""Every layout evaluated on the user's hardware: one `Estimate` per strategy.

`evaluate` fills one `Estimate` per strategy: bytes per GPU by component (the worst rank: FSDP
rank 0 holds the largest chunk, pipeline stage 0 the most in-flight activations unless the last
stage's loss outweighs it), whether it fits in the GPU's memory minus a fixed overhead (CUDA
context, cuBLAS/NCCL workspaces, allocator slack: `Request.overhead`), bytes on the wire per
step and the time they take, the time of a step and of the whole run (`timing`: model FLOPs
at an assumed MFU, the bubble, exposed communication). Multi-dimensional layouts (FSDP x TP, DDP
or FSDP x PP, FSDP x TP x PP) try every factorisation of the GPUs, TP inside a node and the
pipeline across nodes, and keep the one that fits with the shortest estimated step.

Every layout the planner models, distft runs: whether it runs with the requested method is read
from the strategy's spec, `distft.layout.SPECS` (`runnable`); only those get a `run:` command
(`run_line.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from distft.layout import SPECS
from distft.layout.dims import node_shard
from distft.layout.rules import expert_split, stage_split, tp_split
from distft.measure.flops import StepTime
from distft.plan.activations import activation_bytes
from distft.plan.buffers import comm_buffer_bytes
from distft.plan.collective import Collective, Topology
from distft.plan.hardware import GPU, GiB, Link
from distft.plan.inputs import Parallelism, Training
from distft.plan.memory import state_bytes
from distft.plan.model_spec import ModelSpec
from distft.plan.timing import ASSUMED_MFU, RunLength, no_time_reason, step_time
from distft.plan.traffic import step_collectives


def runnable(strategy: str, method: str = "lora") -> bool:
    """distft can train `strategy` with `method`: it is one of its strategies (and runs QLoRA)."""
    spec = SPECS.get(strategy)
    return spec is not None and (method != "qlora" or spec.runs("qlora"))


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
    mfu: float | None = None  # model FLOPs utilisation assumed; None: `timing.ASSUMED_MFU` for the method
    cp_method: str = "allgather"  # parallel.cp_method of the layouts with cp > 1
    overhead: int = 1 * GiB
    run: RunLength = field(default_factory=RunLength)  # the run's length, for the time to train

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def usable(self) -> int:
        return self.gpu_memory - self.overhead

    @property
    def topology(self) -> Topology:
        return Topology(self.gpus_per_node, self.nodes, self.intra, self.inter)

    @property
    def assumed_mfu(self) -> float:
        return self.mfu or ASSUMED_MFU[self.training.method]

    @property
    def no_time(self) -> str | None:
        """Why no step gets a time (no bf16 peak), or None."""
        return no_time_reason(self.gpu, self.training)


@dataclass
class Estimate:
    strategy: str
    parallelism: Parallelism
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    buffers: int = 0
    fits: bool = False
    applicable: bool = True
    runnable: bool = False  # distft runs it (the registry), with this method
    note: str = ""
    stage: int = 0  # the pipeline stage the figures are for (the fullest)
    activation_detail: dict[str, int] = field(default_factory=dict)
    host_activations: int = 0  # offloaded layer inputs, in host memory (`Activations.host`)
    buffer_detail: dict[str, int] = field(default_factory=dict)
    collectives: list[Collective] = field(default_factory=list)
    time: StepTime | None = None  # the step's predicted time, in parts (None: no bf16 peak)
    tokens_per_step: int = 0
    run_steps: int | None = None  # optimizer steps of the run (None: its length is unknown)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    @property
    def components(self) -> dict[str, int]:
        """The bytes per GPU by component, as the JSON documents and a run's prediction name them."""
        return {
            "parameters": self.params,
            "gradients": self.grads,
            "optimizer_states": self.optimizer,
            "activations": self.activations,
            "communication_buffers": self.buffers,
        }

    @property
    def label(self) -> str:
        lay, spec = self.parallelism, SPECS[self.strategy]
        if lay.dp_shard and lay.replicas > 1:  # HSDP: shard groups x replicas (x TP)
            tp = f"tp={lay.tp}, " if lay.tp > 1 else ""
            return f"{spec.label} ({tp}shard={lay.shard_degree}, replicas={lay.replicas})"
        if 1 < lay.ep < lay.dp:  # fsdp+ep: expert groups x replicas, or their experts sharded across them
            groups = lay.dp // lay.ep
            held = f"experts sharded over {groups}" if lay.shard_experts else f"replicas={groups}"
            return f"{spec.label} (ep={lay.ep}, {held})"
        degrees = [f"{d}={getattr(lay, d)}" for d in ("dp", "tp", "pp", "cp") if getattr(lay, d) > 1]
        ring = ["ring"] if lay.cp > 1 and lay.cp_method == "ring" else []  # allgather goes unsaid
        degrees = (degrees if spec.sized else []) + ring
        return f"{spec.label} ({', '.join(degrees)})" if degrees else spec.label

    @property
    def comm_bytes(self) -> float:
        return sum(c.wire_bytes for c in self.collectives)

    @property
    def comm_s(self) -> float:
        return sum(c.seconds for c in self.collectives)

    @property
    def compute_s(self) -> float | None:
        return self.time.compute_s if self.time else None

    @property
    def step_s(self) -> float | None:
        return self.time.seconds if self.time else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens_per_step / self.step_s if self.step_s else None

    @property
    def train_s(self) -> float | None:
        """Seconds for the whole run: step time x steps (None without either)."""
        return self.step_s * self.run_steps if self.step_s and self.run_steps else None

    @property
    def min_global_batch(self) -> int:
        """Sequences per optimizer step at the least: one micro-batch per data-parallel replica."""
        lay = self.parallelism
        return lay.dp * lay.microbatches if lay.pp > 1 else lay.dp

    @property
    def in_distft(self) -> str:
        """The report's "distft" column: "yes", or "no" for a layout only the planner models."""
        return "yes" if self.runnable else "no"


# ---- Evaluating layouts -------------------------------------------------------------------------


def parallelism_for(
    req: Request,
    strategy: str,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 0,
    shard_experts: bool = False,
) -> Parallelism:
    """How `strategy` splits the work at these degrees, as the runtime builds it (its class says
    what it shards and how it splits a layer; HSDP shards inside a node; fsdp+ep's expert groups
    are `ep` ranks, 0: every data-parallel rank, their stacks FSDP-sharded across the groups or
    not)."""
    m = (req.pp_microbatches or max(req.grad_accum, 2 * pp)) if pp > 1 else req.grad_accum
    shard = node_shard(req.gpus_per_node, dp, tp, cp)  # HSDP's shard group: a node's data ranks
    schedule = {"microbatches": m, "schedule": req.pp_schedule, "shard_experts": shard_experts}
    schedule |= {"cp_method": req.cp_method} if cp > 1 else {}
    return Parallelism.at(strategy, dp, tp, pp, cp, shard, ep, **schedule)


def why_not(req: Request, par: Parallelism) -> str:
    """Empty if the layout can run on this model and these GPUs, else the reason."""
    spec, tp = req.model, par.tp
    if moe := _why_not_experts(req, par):
        return moe
    if par.world > req.world:
        return f"needs {par.world} GPUs"
    if par.world < 2 and SPECS[par.name].distributed:
        return "needs 2+ GPUs"
    mlps = {"intermediate_size": spec.intermediate_size}
    mlps |= {"moe_intermediate_size": spec.moe_intermediate_size} if spec.moe else {}
    if tp > 1 and (why := tp_split(tp, spec.num_heads, spec.num_kv_heads, mlps)):  # the runtime's rules
        return f"TP degree {tp}: {why}"
    if why := stage_split(par.pp * (par.virtual_stages if par.pp > 1 else 1), spec.num_layers):
        return f"needs {why}, the model has {spec.num_layers}"
    if tp > 1 and req.training.method == "qlora" and not SPECS[par.name].runs("qlora"):
        return "QLoRA's NF4 weights are not split by distft's TP"
    if par.dp_shard and par.replicas < 2:
        return "one node: its shard group is every GPU, i.e. plain FSDP (HSDP needs 2+ nodes)"
    return ""


def _why_not_experts(req: Request, par: Parallelism) -> str:
    """Empty if the layout can hold this model's MLPs, dense or a mixture of experts."""
    spec, layout = req.model, SPECS[par.name]
    if not spec.moe:
        return "needs a mixture of experts" if layout.expert_groups else ""
    if not layout.runs("moe"):
        return "does not split a mixture of experts yet"
    if req.training.method == "qlora":
        return "QLoRA's NF4 base does not hold the experts' fused stacks"
    if par.ep > 1 and (why := expert_split(par.ep, spec.num_experts)):
        return f"EP degree {par.ep}: {why}"
    return ""


def estimate(req: Request, par: Parallelism, strategy: str | None = None) -> Estimate:
    """Per-GPU memory of the fullest rank, traffic and time for one layout."""
    est = Estimate(strategy or par.name, par)
    est.runnable = runnable(est.strategy, req.training.method)
    if why := why_not(req, par):
        est.applicable, est.note = False, why
        return est
    worst = None
    for stage in range(par.pp):
        state = state_bytes(req.model, req.training, par, stage=stage)
        act = activation_bytes(req.model, req.training, par, stage)
        buffers = comm_buffer_bytes(req.model, req.training, par, stage)
        total = state.total + act.total + sum(buffers.values())
        if worst is None or total > worst[0]:
            worst = (total, stage, state, act, buffers)
    _, est.stage, state, act, buffers = worst
    est.params, est.grads, est.optimizer = state.params, state.grads, state.optimizer
    est.activations, est.activation_detail = act.total, {**act.detail, "transient": act.transient}
    est.host_activations = act.host
    est.buffers, est.buffer_detail = sum(buffers.values()), buffers
    est.fits = est.total <= req.usable
    est.collectives = step_collectives(req.model, req.training, par, req.topology)
    est.time = step_time(req.model, req.training, par, est.collectives, req.gpu, req.assumed_mfu)
    est.tokens_per_step = req.training.micro_batch * req.training.seq_len * par.microbatches * par.dp
    est.run_steps = req.run.steps_for(est.tokens_per_step)
    if par.tp > req.gpus_per_node:
        est.note = "TP group spans nodes"
    return est


def max_micro_batch(req: Request, par: Parallelism, strategy: str | None = None, limit: int = 256) -> int:
    """The largest micro-batch (up to `limit`) with which layout `par` still fits, the rest of
    `req` unchanged; 0 if not even one sequence does. Memory grows with the micro-batch
    (activations, the loss's logits), so a doubling then a bisection finds it."""

    def fits(m: int) -> bool:
        return estimate(replace(req, training=replace(req.training, micro_batch=m)), par, strategy).fits

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, 2 * high
    high = min(high, limit + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def best(candidates: list[Estimate]) -> Estimate | None:
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


def candidate_parallelisms(req: Request, strategy: str) -> list[Parallelism]:
    """Every factorisation of the GPUs `strategy` is tried with: a strategy on one mesh dimension
    takes every GPU on it; on several, TP and CP stay inside a node, the pipeline is outermost
    (across nodes when there are several) and 2+ data-parallel ranks sit between (1+ beside CP,
    whose ranks FSDP shards over too); fsdp+ep's expert groups of 2+ ranks dividing the GPUs, those
    below all of them with their stacks replicated across the groups or sharded."""
    dims, n = SPECS[strategy].axes, req.world
    if SPECS[strategy].expert_groups:  # fsdp+ep: expert groups of every size, all the GPUs by default
        groups = [(n, False)] + [(ep, shard) for ep in _divisors(n)[:-1] for shard in (False, True)]
        return [parallelism_for(req, strategy, dp=n, ep=ep, shard_experts=s) for ep, s in groups]
    if len(dims) < 2:
        return [parallelism_for(req, strategy, **{d: n for d in dims})]
    return [
        parallelism_for(req, strategy, dp=n // (tp * pp * cp), tp=tp, pp=pp, cp=cp)
        for tp in (_divisors(req.gpus_per_node) if "tp" in dims else [1])
        for cp in (_divisors(req.gpus_per_node // tp) if "cp" in dims else [1])
        for pp in (_divisors(n // (tp * cp)) if "pp" in dims else [1])
        if n % (tp * pp * cp) == 0 and n // (tp * pp * cp) >= (1 if "cp" in dims else 2)
    ]


def evaluate(req: Request) -> dict[str, Estimate]:
    """One estimate per modelled strategy; 2-D layouts keep their best factorisation."""
    out: dict[str, Estimate] = {}
    for strategy in SPECS:
        layouts = candidate_parallelisms(req, strategy)
        if not layouts:
            out[strategy] = Estimate(
                strategy,
                Parallelism(strategy),
                applicable=False,
                runnable=runnable(strategy, req.training.method),
                note=f"needs {2 ** len(SPECS[strategy].axes) if 'cp' not in SPECS[strategy].axes else 2}+ GPUs",
            )
            continue
        est = best([estimate(req, lay, strategy) for lay in layouts])
        if est is not None:
            out[strategy] = est
    return out
