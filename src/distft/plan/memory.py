"""What fills a GPU during finetuning, per rank and per layout: the formulas, one function each.

Five components, in bytes per rank:

1. Parameters. Every weight in the model dtype (`Precision.param`: 2 for bf16). QLoRA stores
   the projections' weights in NF4, exactly as the runtime does (`distft.model.nf4.nf4_bytes`:
   torchao's NF4Tensor, scales in the model dtype); embeddings, norms, biases (Qwen2's q/k/v) and
   lm_head stay 16-bit.
2. Gradients. Trainable weights only, in `Precision.grad`: the whole model for full finetuning,
   for (Q)LoRA the adapters and what trains beside them (`trained_beside`).
3. Optimizer state (each `optim.name`'s: `optimizer.py`). AdamW keeps two moments per trainable
   element (`Precision.state` bytes each) and, under mixed precision, an fp32 master copy
   (`Precision.master`), plus one fp32 step counter per trainable tensor: 2 + 2 + 4 + 4 + 4 = 16
   bytes per trained parameter under mixed precision, 12 for bf16 weights with fp32 moments (the
   blog series' 13B table: 26 + 26 + 104 = 156 GB). LoRA pays this only on the adapters, which PEFT
   keeps in fp32 over a 16-bit base (`autocast_adapter_dtype`): 4 + 4 + 8 = 16 bytes per parameter.
4. Activations: what autograd saves for backward (`activations.activation_bytes`), plus a
   transient working set (one layer's recompute under activation checkpointing, or the logits).
5. Communication buffers: FSDP's gathered (unsharded) parameters and unsharded gradients
   before their reduce-scatter, TP/SP and pipeline send/receive buffers, the dequantized QLoRA
   weight (`buffers.comm_buffer_bytes`). ZeRO-1 adds none: its broadcast buckets are the weights
   themselves (`parameters_as_bucket_view`), DDP's all-reduce buckets the gradients.

How layouts divide the first three (`state_bytes`; `Layout` says which applies):
- single, DDP: nothing divided (DDP's gradient buckets are the gradients: `gradient_as_bucket_view`).
- ZeRO-1 (`zero1`): the optimizer state of whole tensors, partitioned as torch's
  ZeroRedundancyOptimizer does (`zero1_partition`: largest first, each to the rank with the fewest
  elements so far), about 1/N per rank.  FSDP2 (`fsdp` ZeRO-3, `zero2`, and `hsdp` with N its
  shard degree): parameters, gradients and optimizer state / N, tensor by tensor along dim 0,
  padded to a multiple of N: a parameter or gradient takes ceil(d0/N) rows on every rank, the
  optimizer state (`zeros_like` of the unpadded local view) this rank's torch.chunk rows only.
  ZeRO-2 persists the same shards, and keeps every layer gathered from forward to backward.
- TP, TP+SP, FSDP x TP: each projection split on dim 0 (q, k, v, gate, up) or dim 1 (o, down), a
  bias with its weight's rows; embeddings, norms and lm_head replicated. LoRA adapters follow their
  base (`ModelSpec.lora_tensors`). FSDP2 pads each tensor on its own, biases included.
- PP: a rank holds the layers of its stages (the runtime's `Layout.layers_of`); the rank of the
  first stage the embeddings, that of the last stage the final norm and lm_head (a tied lm_head
  is a copy of the embedding there).
- FSDP x EP: 1/EP of each expert stack, whole experts, with their gradients and optimizer state
  (`experts.expert_parallel`), or 1/N of it where FSDP2 shards the stacks across the N/EP expert
  groups (`parallel.shard_experts`: one layer's gathered at a time); FSDP2's shards of the rest,
  and one layer's all-to-all buffers.
The activation model is in `activations.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from distft.model.nf4 import NF4Spec, nf4_bytes
from distft.plan.experts import expert_parallel, expert_shards
from distft.plan.inputs import (
    Parallelism,
    Training,
    holds_first_stage,
    holds_last_stage,
    pipeline_layout,
    rank_layers,
)
from distft.plan.model_spec import ModelSpec, TensorSpec
from distft.plan.optimizer import optimizer_state_bytes, shared_state_bytes, zero1_partition

ADAPTER_KINDS = ("lora_A", "lora_B", "lora_magnitude")  # trainable adapter tensors, in adapter_bytes


# ---- QLoRA storage ------------------------------------------------------------------------------


def nf4_tensor_bytes(numel: int, quant: NF4Spec, itemsize: int, shards: int = 1) -> int:
    """Bytes of one NF4 weight on one of `shards` FSDP ranks: the runtime's `distft.model.nf4.nf4_bytes`."""
    return sum(nf4_bytes(numel, quant, itemsize, shards).values())


# ---- Which tensors a rank holds -----------------------------------------------------------------


def chunk_rows(d: int, n: int, rank: int) -> int:
    """Rows rank `rank` gets when torch.chunk splits `d` rows n ways (DTensor Shard, FSDP2)."""
    size = math.ceil(d / n)
    return max(0, min(size, d - rank * size))


def local_shape(t: TensorSpec, tp: int, tp_rank: int, ep: int = 1) -> tuple[int, ...]:
    if ep > 1 and t.kind == "experts":
        return (t.shape[0] // ep, *t.shape[1:])  # this rank's experts
    if tp == 1 or t.tp_dim is None:
        return t.shape
    shape = list(t.shape)
    shape[t.tp_dim] = chunk_rows(shape[t.tp_dim], tp, tp_rank)
    return tuple(shape)


def stage_tensors(
    spec: ModelSpec, training: Training, par: Parallelism, rank: int, stage: int | None = None
) -> list[tuple[TensorSpec, bool]]:
    """(tensor, trainable) held by pipeline rank `rank` (the whole model when pp == 1), or by its
    pipeline stage `stage` alone."""
    if stage is None:
        layers = set(rank_layers(spec, training, par, rank))
        first, last = holds_first_stage(par, rank), holds_last_stage(par, rank)
    else:
        lay = pipeline_layout(spec, training, par)
        layers, first, last = set(lay.layers_of(stage)), stage == 0, stage == lay.num_stages - 1
    full = training.method == "full"
    out = []
    base = [(t, full) for t in spec.tensors()] + [(t, True) for t in trained_beside(spec, training)]
    for t, trains in base:
        if t.layer is not None:
            keep = t.layer in layers
        elif t.kind == "embed":
            keep = first or (last and spec.tie_word_embeddings)  # a tied lm_head: a copy per end
        else:
            keep = last
        if keep:
            out.append((t, trains))
    if training.lora:
        out += [
            (t, True)
            for t in spec.lora_tensors(training.lora_rank, training.lora_targets, training.dora)
            if t.layer in layers
        ]
    return out


# ---- Parameters, gradients, optimizer state -----------------------------------------------------


@dataclass
class StateBytes:
    params: int = 0
    grads: int = 0
    optimizer: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def param_element_bytes(t: TensorSpec, training: Training) -> float:
    """Bytes per element of a weight as stored (NF4 projections: the runtime's formula / numel)."""
    if training.method == "qlora" and t.kind == "linear":
        return nf4_tensor_bytes(t.numel, training.quant, training.precision.param) / t.numel
    if t.kind in ADAPTER_KINDS:
        return training.adapter_bytes
    if training.fp32_masters and training.method == "full":
        return 4  # the fp32 master weights are the weights; bf16 copies are made per op
    return training.precision.param


def trained_element_bytes(t: TensorSpec, training: Training) -> tuple[int, int, int]:
    """(gradient, one AdamW moment, master copy) bytes per element of a trainable tensor
    (`optimizer.optimizer_state_bytes` turns the last two into each optimizer's state).

    fp32 adapters carry fp32 gradients and fp32 AdamW moments and need no master copy: 4 + 8
    bytes, whatever the base's precision (adapters as light as 16-bit follow the precision).
    """
    p = training.precision
    if t.kind in ADAPTER_KINDS and training.adapter_bytes == 4:
        return 4, 4, 0
    if training.fp32_masters and training.method == "full":
        return 4, 4, 0  # fp32 gradients (of the fp32 weights) and fp32 moments; no separate master
    return p.grad, p.state, p.master


def _param_bytes(t: TensorSpec, training: Training, shape: tuple[int, ...], shards: int) -> int:
    """One rank's bytes of a weight of local `shape`, sharded `shards` ways by FSDP2 (dim-0 padded)."""
    numel = math.prod(shape)
    if training.method == "qlora" and t.kind == "linear":
        return nf4_tensor_bytes(numel, training.quant, training.precision.param, shards)
    rows = math.ceil(shape[0] / shards) if shape[0] else 0
    rest = numel // shape[0] if shape[0] else 0
    return math.ceil(rows * rest * param_element_bytes(t, training))


def state_bytes(
    spec: ModelSpec, training: Training, par: Parallelism, dp_rank: int = 0, tp_rank: int = 0, stage: int = 0
) -> StateBytes:
    """Parameters, gradients and optimizer state held by one rank, in bytes (the counted storage).

    Exact for distft's strategies (checked against the wrapped models in tests/plan): FSDP2's
    padded parameter and gradient shards, the unpadded optimizer chunks, ZeRO-1's partition of
    whole tensors, AdamW's step tensors.
    """
    out = StateBytes()
    sharded, n = par.shard == "full", par.shard_degree  # FSDP's degree (HSDP: one shard group's)
    held = stage_tensors(spec, training, par, stage)
    trained = [math.prod(local_shape(t, par.tp, tp_rank, par.ep)) for t, trains in held if trains]
    # ZeRO-1: the rank whose AdamW updates each trained tensor.
    owners = iter(zero1_partition(trained, par.dp) if par.shard == "optimizer" else [])
    kept = []  # local elements of the whole tensors whose state this rank keeps
    for t, trainable in held:
        shape = local_shape(t, par.tp, tp_rank, par.ep)
        numel = math.prod(shape)
        rest = numel // shape[0] if shape[0] else 0
        gbytes, moment, master = trained_element_bytes(t, training)
        # dp_rank % n: the rank's place in its shard group (HSDP's replicas hold the same chunks);
        # fsdp+ep's sharded experts: its expert group's place among the groups.
        experts = expert_parallel(t, par)
        shards, place = (expert_shards(par), dp_rank // par.ep) if experts else (n, dp_rank % n)
        fsdp = sharded and (shards > 1 or not experts)
        out.params += _param_bytes(t, training, shape, shards if fsdp else 1)
        if not trainable:
            continue
        if fsdp:
            out.grads += math.ceil(shape[0] / shards) * rest * gbytes
            out.optimizer += optimizer_state_bytes(
                chunk_rows(shape[0], shards, place) * rest, moment, master, training
            )
        elif par.shard == "optimizer":  # ZeRO-1: whole gradients, the state of this rank's tensors
            out.grads += numel * gbytes
            if next(owners) == dp_rank:
                out.optimizer += optimizer_state_bytes(numel, moment, master, training)
        else:
            out.grads += numel * gbytes
            out.optimizer += optimizer_state_bytes(numel, moment, master, training)
            kept.append(numel)
    out.optimizer += shared_state_bytes(kept, training)  # strategies that shard build no 8-bit AdamW
    return out


def trained_beside(spec: ModelSpec, training: Training) -> list[TensorSpec]:
    """What trains beside LoRA's adapters (`distft.model.tokens`), in the base's dtype: a copy of
    every weight of each `lora.modules_to_save` module (peft's ModulesToSaveWrapper; a tied
    embedding and lm_head copied once), and a delta of each added token's row in the embedding and
    an untied lm_head (peft's TrainableTokensLayer) where that module is not copied whole."""
    if not training.lora:
        return []
    names = set(training.modules_to_save)
    if spec.tie_word_embeddings and "lm_head" in names:
        names.add("embed_tokens")  # the tied lm_head is the embedding
    tensors = spec.tensors()
    copies = [
        replace(t, name=f"{t.name}.modules_to_save")
        for t in tensors
        if (t.module or t.name.rsplit(".", 1)[-1]) in names
    ]
    rows = [
        TensorSpec(f"{t.name}.trainable_tokens", (training.trainable_tokens, spec.hidden_size), t.kind)
        for t in tensors
        if t.kind in ("embed", "lm_head") and t.name not in names and training.trainable_tokens
    ]
    return copies + rows


def trainable_params(spec: ModelSpec, training: Training) -> int:
    if training.method == "full":
        return spec.num_params()
    lora = spec.lora_tensors(training.lora_rank, training.lora_targets, training.dora)
    return sum(t.numel for t in lora + trained_beside(spec, training))


# ---- Communication and other transient buffers --------------------------------------------------


def layer_seq_len(training: Training, par: Parallelism, seq_len: int | None = None) -> int:
    """Sequence length (`training.seq_len`, or `seq_len`) as the layers see it: TP+SP pads it to
    a multiple of the TP degree."""
    seq = training.seq_len if seq_len is None else seq_len
    return math.ceil(seq / par.tp) * par.tp if par.sp and par.tp > 1 else seq
