"""Tensor parallelism's bytes per step: the activation collectives inside every layer (DTensor
plans' all-reduces, or the Megatron layers' all-gathers and reduce-scatters with sequence
parallelism), and the partial gradients of the weights TP replicates. `traffic.step_collectives`
names them "tp"; the counts per layer are `counts.py`'s, an MoE's expert terms `expert_traffic.py`'s.
"""

from __future__ import annotations

import math

from distft.plan import expert_traffic as experts
from distft.plan.collective import Collective, step_positions
from distft.plan.counts import frozen_embedding, megatron_crossings, tp_activation_calls, tp_adapter_calls
from distft.plan.hardware import Link
from distft.plan.inputs import Parallelism, Training, compute_bytes, rank_layers, rank_stages
from distft.plan.memory import trained_beside
from distft.plan.model_spec import ModelSpec
from distft.plan.preference_traffic import sequence_sums, sp_forward_only_crossings, tp_forward_only_reduces

# ---- Per-collective formulas (bytes and calls per optimizer step, one rank) ---------------------


def tp_collectives(
    spec: ModelSpec, training: Training, par: Parallelism, link: Link, layers: int, rank: int = 0
) -> list[Collective]:
    """Tensor parallelism's activation collectives and the replicated weights' partial gradients."""
    m, c, lora = len(training.shapes(par.microbatches)), compute_bytes(training, par), training.lora
    positions, ckpt = step_positions(training, par), training.activation_checkpointing  # every micro-batch's
    targets, frozen = set(training.lora_targets) if lora else set(), frozen_embedding(spec, training)
    out = []
    if par.tensor_parallel == "megatron":
        # A block's entry carries a norm output (the weights' dtype) forward and its gradient
        # back; an exit a projection output (the compute dtype) and its gradient: with SP an
        # entry all-gathers forward and reduce-scatters backward, an exit the other way round.
        enters, leaves, enters_bwd, leaves_bwd, *_ = megatron_crossings(layers, frozen, targets, ckpt)
        enter = positions * spec.hidden_size * training.precision.param
        leave = positions * spec.hidden_size * (2 if training.autocast else c)  # bf16 under autocast
        moe = experts.megatron_expert_terms(spec, training, par, layers, targets)  # an MoE's choices
        if par.sp:
            gathered, gathers = enter * enters + leave * leaves_bwd, m * (enters + leaves_bwd)
            scattered, scatters = leave * leaves + enter * enters_bwd, m * (leaves + enters_bwd)
            extra = sp_forward_only_crossings(training, par, layers, enter / positions, leave / positions)
            gathered, gathers, scattered, scatters = (
                a + b + e
                for a, b, e in zip((gathered, gathers, scattered, scatters), extra, moe, strict=True)
            )
            out.append(Collective("activations", "all_gather", gathered, gathers, par.tp, link, False))
            out.append(Collective("activations", "reduce_scatter", scattered, scatters, par.tp, link, False))
            if training.pair_statistics:  # each sequence's log-probability and count, summed over the ranks
                out.append(sequence_sums(training, par, link, par.tp))
            out += experts.cp_router_sums(spec, par, link, m, ranks=par.tp)  # pooled over the shards
        else:  # forwards without backward: each block's exit all-reduced once per model run
            _, _, extra, extra_calls = sp_forward_only_crossings(training, par, layers, 0, leave / positions)
            logical = leave * leaves + enter * enters_bwd + extra + moe[2]
            calls = m * (leaves + enters_bwd) + extra_calls + moe[3]
            out.append(Collective("activations", "all_reduce", logical, calls, par.tp, link, False))
    else:
        # Per stage this rank holds: a later stage's input needs its gradient (it is sent back).
        stages = rank_stages(spec, training, par, rank)
        calls = sum(tp_activation_calls(n, frozen, ckpt, not first) for n, first in stages)
        adapters = tp_adapter_calls(layers, targets, ckpt)
        logical = c * positions * (spec.hidden_size * calls + training.lora_rank * adapters)
        count = m * (calls + adapters)
        if spec.moe:  # the experts' all-reduces in place of a dense MLP's
            moe_bytes, moe_calls = experts.tp_expert_terms(spec, training, par, layers, targets)
            logical, count = logical + moe_bytes, count + moe_calls
        extra, extra_calls = tp_forward_only_reduces(spec, training, par, layers, targets, c)
        logical, count = logical + extra, count + extra_calls
        out.append(Collective("activations", "all_reduce", logical, count, par.tp, link, False))
    partial = partial_grad_bytes(spec, training, par, rank)
    if partial:
        out.append(Collective("partial gradients", "all_reduce", partial, 1, par.tp, link, False))
    return out


def partial_grad_bytes(spec: ModelSpec, training: Training, par: Parallelism, rank: int = 0) -> float:
    """Replicated trainable weights whose gradients each TP rank has only in part (summed once per step)."""
    g = training.precision.grad
    layers = rank_layers(spec, training, par, rank)
    if par.tensor_parallel == "dtensor":
        # parallelize_module: only q_norm / k_norm's (full finetuning; DTensor completes LoRA's own
        # gradients), sharded over FSDP's ranks (HSDP x TP: a shard group's) (`parallel/tensor_parallel.py`).
        dp = par.shard_degree if par.shard == "full" else 1
        if training.lora:  # an MoE's whole expert adapter factors (`parallel/tp_experts.py`)
            return experts.tp_expert_partial_grads(spec, training, layers, dp) if spec.moe else 0.0
        return 2 * math.ceil(spec.head_dim / dp) * len(layers) * g if spec.qk_norm else 0.0
    if training.lora:  # with SP, what trains beside the adapters (`lora.modules_to_save`) too
        held = set(layers)
        lora = spec.lora_tensors(training.lora_rank, training.lora_targets, training.dora)
        partial = [t for t in lora if t.tp_dim is None and t.layer in held]
        return sum(t.numel for t in partial + (trained_beside(spec, training) if par.sp else [])) * g
    qk = 2 * spec.head_dim * len(layers) if spec.qk_norm else 0
    if par.tensor_parallel == "megatron" and par.sp:  # every replicated weight sees a sequence shard
        norms = 2 * spec.hidden_size * len(layers) + spec.hidden_size
        embed = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
        routers = spec.num_experts * spec.hidden_size * len(layers) if spec.moe else 0  # each routes a shard
        return (qk + norms + embed + routers) * g
    return qk * g
