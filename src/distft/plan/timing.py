"""Time per optimizer step and time to train, for a layout the planner evaluated.

A step's time is three parts (`distft.measure.flops.StepTime` adds them):

1. **Compute**: the model FLOPs of the busiest rank / (the GPU's dense bf16 peak x an assumed
   MFU). The FLOPs are `distft.measure.flops`'s count, the one every run's MFU uses: a frozen
   weight 4N per token, a trained one 6N, causal attention 6 s^2 d_attn per sequence and layer,
   the LM head on the labelled positions only; `model_flops` builds that count from a
   `ModelSpec` instead of a model. A rank runs its pipeline stages' layers (the head on the last
   stage's rank), 1/tp of the layers' matmuls under TP (and of the head under sequence
   parallelism), its micro-batches, and one more forward of its layers with activation
   checkpointing. The busiest pipeline rank sets the pace.
2. **The pipeline's bubble**: the layout's idle share f of the step (`Parallelism.idle_fraction`,
   the runtime's own pipeline layout), so compute x f / (1 - f) more.
3. **Exposed communication** (`distft.plan.traffic`'s collectives, `hardware.comm_time`):
   collectives that overlap compute (DDP's bucketed gradient all-reduce, FSDP's prefetched
   all-gathers and reduce-scatters, HSDP's, a pipeline's sends) show only where they outlast the
   compute; those on the critical path (TP's and TP+SP's activation collectives, the partial
   gradients' all-reduce, ZeRO-1's broadcast of the updated weights, a tied embedding's gradient
   across stages) add their whole time. This is the optimistic end: in practice DDP's last
   bucket and FSDP's first gather do not hide.

**The assumed MFU** (`ASSUMED_MFU`) is distft's own, measured: `distft bench --gpu` on one H200,
Qwen3-4B, 2048-token sequences, micro-batch 2 (docs/reports/gpu/nvidia-h200/): 37% for LoRA, 36%
for QLoRA, 43% for full finetuning. It is taken for every GPU and model (`--mfu` overrides it):
smaller models, shorter sequences and micro-batches of one reach less, consumer cards and
attention-heavy long sequences may differ either way.

**Time to train** = step time x steps, where steps = `--steps`, or ceil(tokens x epochs / tokens
per step) with `--tokens` the tokens in the training data and tokens per step = micro-batch x
sequence length x micro-batches x data-parallel replicas: every sequence taken as full (packed
rows, `data.packing`, come close; a set of short unpacked rows takes as many steps as rows /
global batch, each shorter). Without either, the run's length is unknown and only the step's
time is given.

A device without a dense bf16 peak (the CPU, a GPU known only by its memory) gets no time at
all, `no_time_reason` says why: a FLOP-based estimate needs a peak, and none is made up.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from distft.errors import ConfigError
from distft.measure.flops import ModelFlops, StepTime
from distft.parallel.pipeline.cost import attention_dim, layer_weights
from distft.plan.collective import Collective
from distft.plan.experts import expert_imbalance_flops
from distft.plan.hardware import GPU
from distft.plan.inputs import Parallelism, Training, holds_last_stage, rank_layers
from distft.plan.model_spec import ModelSpec

# distft's measured MFU on one H200 (docs/reports/gpu/nvidia-h200/RECORD.md: Qwen3-4B, 2048
# tokens, micro-batch 2, bf16, flex attention, compiled layers): the default assumption.
ASSUMED_MFU = {"lora": 0.37, "qlora": 0.36, "full": 0.43}
MFU_SOURCE = "distft's measured MFU for Qwen3-4B on one H200 (docs/reports/gpu/nvidia-h200)"
# A mixture of experts' step is priced at that dense MFU (its FLOPs are the active parameters');
# its grouped expert matmuls and routing have no measurement of their own yet.
MOE_MFU_NOTE = "assumed from dense Qwen3-4B measurements; no MoE measurement yet"


def model_flops(
    spec: ModelSpec, training: Training, layers: list[int] | None = None, head: bool = True
) -> ModelFlops:
    """`distft.measure.flops.ModelFlops` of `spec` trained as `training`: the whole model, or the
    decoder layers `layers` (and the head if `head`) of one pipeline rank. A layer's frozen and
    trained weights are the pipeline cost model's (`layer_weights`: LoRA's adapters, full
    finetuning's projections; no elementwise weights, as `ModelFlops.from_model`); full
    finetuning trains the head too."""
    count = spec.num_layers if layers is None else len(layers)
    frozen, trained = layer_weights(spec, training.method, training.lora_rank, training.lora_targets)
    return ModelFlops(
        frozen=count * frozen,
        trainable=count * trained,
        head=spec.vocab_size * spec.hidden_size if head else 0,
        head_trains=training.method == "full",
        layers=count,
        attn_dim=attention_dim(spec),
    )


def labelled(training: Training) -> int:
    """Positions per sequence that carry the loss (where the head runs)."""
    return min(training.label_tokens, training.seq_len)


def forward_only_runs(training: Training) -> int:
    """Forwards without backward per sequence: DPO's and KTO's reference under the disabled
    adapters, KTO's KL term (`distft.plan.preference_traffic`)."""
    return training.reference_forward + training.kl_forwards


def step_flops(spec: ModelSpec, training: Training, par: Parallelism) -> float:
    """Model FLOPs of one optimizer step, every rank together (what a run's MFU counts)."""
    sequences = training.micro_batch * par.microbatches * par.dp
    f, S, L = model_flops(spec, training), training.seq_len, labelled(training)
    return sequences * (f.sequence(S, L) + forward_only_runs(training) * f.forward(S, L))


def rank_flops(spec: ModelSpec, training: Training, par: Parallelism) -> float:
    """FLOPs the busiest rank runs per optimizer step: its pipeline stages' layers (recomputed
    once more with checkpointing) over tp, the head on the last stage's rank (over tp with
    sequence parallelism, else whole on every TP rank), for each of its sequences."""
    S = training.seq_len
    busiest = 0.0
    for rank in range(par.pp):
        f = model_flops(spec, training, rank_layers(spec, training, par, rank), holds_last_stage(par, rank))
        runs = forward_only_runs(training)  # their layers' forward (`recompute`) and head's forward
        layers = f.layers_flops(S) + recompute_flops(f, spec, training, S) + runs * f.recompute(S)
        head = f.head_flops(labelled(training)) + runs * (f.forward(S, labelled(training)) - f.recompute(S))
        # TP splits every layer's work, CP every sequence's (evenly: the head/tail chunks)
        layers += expert_imbalance_flops(spec, training, par, S)  # the busiest EP rank's extra rows
        busiest = max(busiest, layers / (par.tp * par.cp) + head / (par.tp if par.sp else 1))
    return busiest * training.micro_batch * par.microbatches


def recompute_flops(f: ModelFlops, spec: ModelSpec, training: Training, seq: int) -> float:
    """What backward runs again, per sequence: every layer's forward (full, offload), or the MLP's
    three frozen projections (selective, or a tiled MLP on top; its adapters are a rounding error)."""
    level = training.activation_checkpointing
    width = spec.num_experts_per_tok * spec.moe_intermediate_size if spec.moe else spec.intermediate_size
    mlp = 2 * seq * f.layers * 3 * spec.hidden_size * width  # an MoE's: a token's top-k experts
    tiled = mlp if training.mlp_tiles > 1 and level != "selective" else 0  # a tiled MLP reruns its tiles
    if level == "selective":
        return mlp
    return (f.recompute(seq) if level != "none" else 0) + tiled


def no_time_reason(gpu: GPU, training: Training) -> str | None:
    """Why a step on `gpu` gets no time estimate, or None when it gets one."""
    if not gpu.bf16_tflops:
        return f"no bf16 peak for {gpu.label}"
    if not training.autocast and training.precision.activation == 4:
        return f"fp32 compute: {gpu.label}'s peak is bf16's"
    return None


def step_time(
    spec: ModelSpec, training: Training, par: Parallelism, collectives: list[Collective], gpu: GPU, mfu: float
) -> StepTime | None:
    """The predicted time of one optimizer step (see the module docstring), or None without a peak."""
    if no_time_reason(gpu, training):
        return None
    return StepTime(
        compute_s=rank_flops(spec, training, par) / (gpu.bf16_tflops * 1e12 * mfu),
        idle_fraction=par.idle_fraction(),
        blocking_s=sum(c.seconds for c in collectives if not c.overlapped),
        overlapped_s=sum(c.seconds for c in collectives if c.overlapped),
        flops=step_flops(spec, training, par),
    )


# ---- The run's length ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RunLength:
    """How long the run is: `steps` optimizer steps, or `epochs` passes over `tokens` tokens."""

    tokens: int | None = None  # tokens in the training data (--tokens)
    epochs: float = 1.0  # passes over them (--epochs)
    steps: int | None = None  # optimizer steps (--steps, as train.max_steps); wins over tokens

    @property
    def known(self) -> bool:
        return self.steps is not None or self.tokens is not None

    def steps_for(self, tokens_per_step: int) -> int | None:
        """Optimizer steps of the run at `tokens_per_step`, or None when its length is unknown."""
        if self.steps is not None:
            return self.steps
        if self.tokens is None or tokens_per_step <= 0:
            return None
        return max(1, math.ceil(self.tokens * self.epochs / tokens_per_step))

    def describe(self) -> str:
        if self.steps is not None:
            return f"{self.steps:,} steps (--steps)"
        if self.tokens is None:
            return "length unknown (give --tokens or --steps)"
        return f"{self.tokens:,} tokens x {self.epochs:g} epoch{'s' if self.epochs != 1 else ''}"


_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_tokens(text: str) -> int:
    """'50M', '1.2B', '2e9', '300k', '123456' -> a positive token count (decimal suffixes)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?(?:e[0-9]+)?)\s*([kmbgt]?)\s*", str(text).lower())
    value = float(m.group(1)) * _SUFFIXES[m.group(2)] if m else 0
    if value < 1:
        raise ConfigError(
            f"--tokens {text!r} is not a token count. Give a positive number, with k, M, B or T if you "
            "like: 50M, 1.2B, 2e9."
        )
    return int(value)


def format_duration(seconds: float | None) -> str:
    """Hours for a run: '12.4 h', '36 min', '45 s'; '-' for none."""
    if seconds is None:
        return "-"
    if seconds >= 3600:
        return f"{seconds / 3600:,.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"
