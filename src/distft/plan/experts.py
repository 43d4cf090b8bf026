"""A mixture of experts in the planner: what its MoE blocks keep for backward, what expert
parallelism moves and buffers, and what an uneven router costs the busiest rank.

Symbols as in `activations.py`, plus E experts of width I per layer, k of them per token, and
T tokens of a micro-batch in the layer. Every expert's weights count in memory (`ModelSpec.
expert_tensors`), a token's k in FLOPs (`parallel.pipeline.cost.layer_weights`).

What one MoE block keeps for backward (distft's grouped expert matmuls, `model.experts_implementation
=auto`, `distft.model.experts.grouped_lora_experts_forward`, measured on the `qwen3-moe-micro`
preset to the byte):
- the router: its input (c T h) when it trains, its fp32 softmax (4 T E), the renormalised top-k
  probabilities and their sum (4 T (k + 1)), the integer bookkeeping of the sort by expert
  (24 T k: top-k indices, the pairs' order and its inverse);
- per routed row (T k of them): the token's hidden state gathered for its expert (c h), the fused
  gate/up output (c 2I), the SwiGLU product times the row's routing weight (c I; SiLU's output is
  recomputed in backward) and that weight (c). The weight multiplies the row before the down
  projection, so the expert's output is not kept; under expert parallelism it is (c h), as the
  weight stays on the rank that dispatched the row;
- under LoRA on the stacks, per stack (`lora_delta_bytes`): applied to the rows through its
  factors, each routed row's rank-r product (c r); or, where that is fewer multiply-adds
  (`distft.model.experts.merges_delta`: experts narrower than about 6 r, never at a real model's
  width), the merged stack (c E out in); either way a contiguous copy of its B factor (c E r out)
  and, over a 16-bit base, the cast of its A (c E r in). (transformers' own grouped_mm keeps a
  merged copy of every expert's weights, c E 3 I h per layer: the size of the experts themselves,
  1.2 GB a layer on Qwen3-30B-A3B.)
- the expert row offsets of the grouped matmul (4 E).
Tensor parallelism splits everything I-wide; expert parallelism holds E/N of the factors' copies
and computes the rows its experts received.

Expert parallelism (`fsdp+ep`, `parallel/fsdp_ep.py`; its bytes in `expert_traffic.py`), per
micro-batch and MoE layer: the E per-expert counts (8 bytes each) are exchanged once per forward,
the T k routed rows (c h each) go out and come back (dispatch, combine) in forward and again in
backward, and in the forward a checkpointed layer recomputes. A rank dispatches its own tokens'
rows (T k) and combines the rows its experts took: planned as the mean, T k each, exact summed
over the ranks. The busiest rank takes `Training.expert_imbalance` times the even share (the
router's imbalance: a run's metrics.jsonl records its busiest expert over the mean as
`expert_imbalance`, a bound on a rank's), which sizes its receive buffer, its expert activations
and its expert FLOPs (`expert_imbalance_flops`): every rank waits for the busiest at the next
all-to-all, so the step takes the busiest rank's time.
"""

from __future__ import annotations

import math
from dataclasses import replace

from distft.model.experts import merges_delta
from distft.parallel.pipeline.cost import layer_weights, matmul
from distft.plan.inputs import Parallelism, Training, compute_bytes
from distft.plan.model_spec import ModelSpec, TensorSpec


def expert_parallel(t: TensorSpec, par: Parallelism) -> bool:
    """An expert stack that expert parallelism splits: 1/ep of the experts on each rank, outside
    the FSDP of the rest (`parallel/fsdp_ep.py`): whole, or FSDP-sharded across the groups alone
    (`expert_shards`)."""
    return par.ep > 1 and t.kind == "experts"


def expert_shards(par: Parallelism) -> int:
    """Ranks each of a rank's expert stacks is FSDP-sharded across: the dp / ep expert groups
    where `parallel.shard_experts` shards them, else 1 (whole on each rank)."""
    return par.dp // par.ep if par.ep > 1 and par.shard_experts else 1


def received_share(training: Training, par: Parallelism) -> float:
    """Routed rows the busiest rank's experts take, as a multiple of T k: its imbalance under
    expert parallelism (every rank computes every expert's rows otherwise)."""
    return training.expert_imbalance if par.ep > 1 else 1.0


def moe_block_bytes(spec: ModelSpec, training: Training, par: Parallelism, tokens: int) -> int:
    """Bytes one MoE block keeps for backward over `tokens` tokens (the module docstring)."""
    c, h, E, k = training.precision.activation, spec.hidden_size, spec.num_experts, spec.num_experts_per_tok
    inter = spec.moe_intermediate_size // par.tp
    full = training.method == "full"
    router = (c * h if full else 0) + 4 * E + 4 * (k + 1) + 24 * k
    rows = math.ceil(tokens * k * received_share(training, par))
    # per row: the gathered hidden state, gate/up's output, the weighted SwiGLU product, the
    # routing weight; and under EP the expert's output, weighted where the row was dispatched
    returned = h if par.ep > 1 else 0
    experts = rows * c * (h + 2 * inter + inter + 1 + returned)
    adapters = 0
    if training.lora and {"gate_proj", "up_proj", "down_proj"} & set(training.lora_targets):
        adapters = sum(
            lora_delta_bytes(training, rows, E // par.ep, out, inp)
            for out, inp in ((2 * inter, h), (h, inter))
        )
    return tokens * router + experts + adapters + 4 * E  # and the experts' row offsets (int32)


def lora_delta_bytes(training: Training, rows: int, experts: int, out: int, inp: int) -> int:
    """What one stack's LoRA delta keeps for backward (`distft.model.experts.grouped_projection`):
    either way a contiguous copy of B (E out r: peft's is a permuted view), and A cast where the
    factors' dtype is not the compute's (E r in); then merged, the merged stack (E out in); through
    the rows, their rank-r product."""
    c, r = training.precision.activation, training.lora_rank
    factors = c * experts * r * (out + (inp if training.adapter_bytes != c else 0))
    if merges_delta(rows, experts, out, inp, r):
        return factors + c * experts * out * inp
    return factors + rows * c * r


def all_to_all_buffer_bytes(spec: ModelSpec, training: Training, par: Parallelism) -> int:
    """One MoE layer's dispatch on the busiest rank: its routed rows sent, and those it received."""
    rows = training.micro_batch * training.seq_len * spec.num_experts_per_tok
    c = compute_bytes(training, par)
    return math.ceil(rows * (1 + received_share(training, par)) * spec.hidden_size * c)


def expert_imbalance_flops(spec: ModelSpec, training: Training, par: Parallelism, tokens: float) -> float:
    """The busiest EP rank's expert FLOPs beyond an even share, over `tokens` tokens of its layers."""
    extra = received_share(training, par) - 1
    if not spec.moe or extra <= 0:
        return 0.0
    args = (training.method, training.lora_rank, training.lora_targets)
    frozen, trained = layer_weights(spec, *args)
    dense_frozen, dense_trained = layer_weights(replace(spec, num_experts_per_tok=0), *args)
    experts = matmul(frozen - dense_frozen, False, tokens) + matmul(trained - dense_trained, True, tokens)
    return extra * spec.num_layers * experts.total
