"""What fills a GPU during finetuning, per rank and per layout: the formulas, one function each.

Five components, in bytes per rank:

1. Parameters. Every weight in the model dtype (`Precision.param`: 2 for bf16). QLoRA stores
   the projections in NF4 (`qlora_base_bytes`); embeddings, norms and lm_head stay 16-bit.
2. Gradients. Trainable weights only, in `Precision.grad`: the whole model for full finetuning,
   the adapters alone for (Q)LoRA.
3. Optimizer state. AdamW keeps two moments per trainable element (`Precision.state` bytes each)
   and, under mixed precision, an fp32 master copy (`Precision.master`), plus one fp32 step
   counter per trainable tensor. Mixed precision is therefore 2 + 2 + 4 + 4 + 4 = 16 bytes per
   trained parameter; bf16 weights with fp32 moments and no master copy is 12 (the seeds' 13B
   table: 26 + 26 + 104 = 156 GB). LoRA pays this only on the adapters, which PEFT keeps in fp32
   over a 16-bit base (`autocast_adapter_dtype`): 4 + 4 + 8 = 16 bytes per adapter parameter.
4. Activations: what autograd saves for backward (`activation_bytes`, the per-layer model
   below), plus a transient working set (one layer's recompute under activation checkpointing,
   or the logits at the loss).
5. Communication buffers: FSDP's gathered (unsharded) parameters and unsharded gradients
   before their reduce-scatter, DeepSpeed's ZeRO-1 buckets, TP/SP and pipeline send/receive
   buffers, the dequantized QLoRA weight (`comm_buffer_bytes`).

How layouts divide the first three (`state_bytes`; `Layout` says which applies):
- single, DDP: nothing divided (DDP's gradient buckets are the gradients: `gradient_as_bucket_view`).
- ZeRO-1: optimizer state / N.  FSDP2 (`fsdp` ZeRO-3, `zero2`): parameters, gradients and
  optimizer state / N, tensor by tensor along dim 0: FSDP2 pads dim 0 to a multiple of N, so a
  parameter or gradient occupies ceil(d0/N) rows on every rank, while the optimizer state (made
  with `zeros_like` on the unpadded local view) takes only this rank's chunk, torch.chunk style
  (rank r: min(ceil(d0/N), d0 - r ceil(d0/N)) rows).  ZeRO-2 persists the same shards as
  ZeRO-3; the difference is a transient buffer: it keeps every layer gathered from forward to
  backward.
- TP, TP+SP: each projection split on dim 0 (q, k, v, gate, up) or dim 1 (o, down); embeddings,
  norms and lm_head replicated. LoRA adapters follow their base (`ModelSpec.lora_tensors`).
- PP: stage s holds its layers; stage 0 the embeddings, the last stage the final norm and lm_head
  (a tied lm_head is a copy of the embedding there).

The activation model, per Qwen3 decoder layer and micro-batch (T = batch x seq tokens, h hidden,
I MLP width, nq/nkv query/KV heads of d, c bytes of the compute dtype, r the LoRA rank). Each
term is a tensor autograd keeps, counted once even when several ops save it:
- RMSNorm (input_layernorm, post_attention_layernorm, q_norm, k_norm): the fp32 upcast input
  (4 T w) and the fp32 reciprocal RMS (4 T per row) when its input needs a gradient; with a
  trainable weight also the normalised input in the compute dtype (c T w). The norm's output is
  kept by the projections that read it when their weights (or LoRA adapters) train: c T h once.
- attention (sdpa, flash-style kernels): q and k after rotary, v, the output (c T d (2nq + 2nkv))
  and the log-sum-exp (4 T nq). With a padding mask transformers expands k and v to all nq heads
  and sdpa keeps the mask (c B S^2 per layer). Eager attention keeps the S x S scores instead:
  the fp32 softmax (4 B nq S^2) and its compute-dtype copy (c B nq S^2 unless c = 4), repeated k
  and v, and the output's contiguous copy.
- MLP: gate output, SiLU output, up output and their product (4 c T I).
- LoRA: each adapted projection keeps lora_A's output (T r). lora_A's input is the projection's
  input, shared, when adapters and activations have the same dtype; PEFT casts the input to the
  adapters' fp32, so over a bf16 base each adapter keeps its own copy of its input (4 T in, or
  c T in under bf16 autocast, which also keeps bf16 casts of the adapter weights). LoRA dropout
  makes a copy too, plus a boolean mask. distft's Megatron layers (tp-sp) do not cast.
- outside the layers: token ids (8 T, full finetuning), rotary cos/sin (2 c S d), the loss mask
  (T bytes), the final norm, lm_head's input (c n h, full finetuning) and the fp32 log-softmax
  (4 n V) over the n labelled positions (distft computes logits only where there is a loss).

Under TP everything inside attention and the MLP is divided by the TP degree (heads and MLP
columns are split) while the norms, the residual stream and the projections' inputs stay whole.
Sequence parallelism also splits what lies between the blocks (norms, residual, loss) along the
sequence; the all-gathered block inputs that column projections keep are still whole. Activation
checkpointing keeps each layer's input only (c T h) and recomputes one layer at a time in
backward. A pipeline stage holds its own layers' activations for every micro-batch in flight:
GPipe m, 1F1B min(m, p - s) (torch's `Schedule1F1B` warms stage s up with that many forwards),
interleaved 1F1B (v chunks per rank) min(m v, (v - 1) m' + 2 (p - 1 - s) + 1) chunks, m' the
micro-batches per round; the first stage holds the most.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from distft.plan.model_spec import COLUMN, DEFAULT_LORA_TARGETS, ModelSpec, TensorSpec

STEP_BYTES = 4  # AdamW's `step`: one fp32 scalar tensor per trainable tensor


@dataclass(frozen=True)
class Precision:
    name: str
    param: int  # bytes per element of the weights the model computes with
    grad: int  # bytes per gradient element
    master: int  # fp32 master copy of trainable weights kept for the optimizer (0: none)
    state: int  # bytes per element of each of AdamW's two moments
    activation: int  # bytes per element of saved activations (the compute dtype)
    description: str

    @property
    def trained_bytes(self) -> int:
        """Bytes per trained parameter: weight + gradient + master + two moments."""
        return self.param + self.grad + self.master + 2 * self.state


PRECISIONS: dict[str, Precision] = {
    "mixed": Precision(
        "mixed", 2, 2, 4, 4, 2, "bf16 weights and gradients, fp32 master weights and AdamW moments"
    ),
    "bf16": Precision("bf16", 2, 2, 0, 4, 2, "bf16 weights and gradients, fp32 AdamW moments, no master"),
    "bf16-pure": Precision(
        "bf16-pure", 2, 2, 0, 2, 2, "all bf16 (distft with model.dtype=bfloat16: AdamW moments in bf16)"
    ),
    "fp32": Precision("fp32", 4, 4, 0, 4, 4, "all fp32 (distft's CPU default)"),
}


@dataclass(frozen=True)
class QuantConfig:
    """NF4 storage (QLoRA). Defaults follow the QLoRA paper / bitsandbytes; see `nf4_bytes`."""

    block_size: int = 64
    double_quant: bool = True
    scaler_block_size: int = 256
    scale_bytes: int = 4  # second-level scale (double quant) or first-level absmax (without)
    per_tensor_bytes: int = 0  # constants per quantized tensor (torchao: mean + 16-entry table)


@dataclass(frozen=True)
class Training:
    """What is trained and on what batch: everything the memory model needs besides the layout."""

    method: str = "lora"  # full | lora | qlora
    precision: Precision = PRECISIONS["mixed"]
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    lora_dropout: float = 0.0
    adapter_bytes: int = 4  # PEFT keeps adapters in fp32 over a 16-bit base (autocast_adapter_dtype)
    autocast: bool = True  # bf16 autocast around forward/backward (distft on CUDA; off on CPU)
    seq_len: int = 2048
    micro_batch: int = 1
    label_tokens: int = 256  # positions per sequence that carry the loss (distft: the summary)
    activation_checkpointing: bool = False
    attention: str = "sdpa"  # sdpa | eager
    padded: bool | None = None  # a padding mask reaches attention; None: micro_batch > 1
    quant: QuantConfig = field(default_factory=QuantConfig)

    @property
    def lora(self) -> bool:
        return self.method in ("lora", "qlora")

    @property
    def has_padding_mask(self) -> bool:
        return self.micro_batch > 1 if self.padded is None else self.padded


@dataclass(frozen=True)
class Layout:
    """How the ranks split the work. world = dp x tp x pp."""

    name: str
    dp: int = 1  # data-parallel degree: replicas (DDP), or shards (ZeRO, FSDP)
    shard: str = "none"  # none | optimizer (ZeRO-1) | full (FSDP2: params, grads, optimizer)
    reshard_after_forward: bool = True  # FSDP2: ZeRO-3 (True) or ZeRO-2 (False)
    fsdp_prefetch: int = 1  # layers gathered ahead (distft's parallel.fsdp_prefetch)
    tp: int = 1
    sp: bool = False
    tp_impl: str = "megatron"  # megatron (tp-sp, hand-rolled) | dtensor (tp, parallelize_module)
    pp: int = 1
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved-1f1b
    microbatches: int = 1  # micro-batches per optimizer step on each pipeline / replica
    virtual_stages: int = 2  # chunks per rank for interleaved-1f1b

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp


# ---------------------------------------------------------------------------------------------
# QLoRA storage
# ---------------------------------------------------------------------------------------------


def nf4_bytes(numel: int, quant: QuantConfig = QuantConfig()) -> float:
    """Bytes of one weight tensor stored in 4-bit NormalFloat.

    0.5 byte per element, plus one absmax scale per block of `block_size` elements: fp32
    (4 bytes) without double quantization; with it, the absmax values are themselves quantized to
    8 bits with one `scale_bytes` scale per `scaler_block_size` blocks, i.e. per element
    1/64 + 4/(64 x 256) ~ 0.0159 bytes instead of 4/64 = 0.0625. `per_tensor_bytes` adds fixed
    constants (torchao's NF4Tensor: the absmax mean and the 16-value code book, in the weight's
    dtype: 17 x 2 bytes for bf16, with `scale_bytes=2`).
    """
    blocks = math.ceil(numel / quant.block_size)
    if quant.double_quant:
        scales = blocks + math.ceil(blocks / quant.scaler_block_size) * quant.scale_bytes
    else:
        scales = blocks * quant.scale_bytes
    return math.ceil(numel / 2) + scales + quant.per_tensor_bytes


def qlora_base_bytes(spec: ModelSpec, quant: QuantConfig = QuantConfig(), unquantized_bytes: int = 2) -> int:
    """The frozen base of a QLoRA model: projections in NF4, everything else 16-bit.

    Embeddings, norms and lm_head (the embedding itself when tied) stay in `unquantized_bytes`
    per element. Adapters are not included (`state_bytes` adds them).
    """
    total = 0.0
    for t in spec.tensors():
        total += nf4_bytes(t.numel, quant) if t.kind == "linear" else t.numel * unquantized_bytes
    return math.ceil(total)


# ---------------------------------------------------------------------------------------------
# Parameters, gradients, optimizer state
# ---------------------------------------------------------------------------------------------


def chunk_rows(d: int, n: int, rank: int) -> int:
    """Rows rank `rank` gets when torch.chunk splits `d` rows n ways (DTensor Shard, FSDP2)."""
    size = math.ceil(d / n)
    return max(0, min(size, d - rank * size))


def local_shape(t: TensorSpec, tp: int, tp_rank: int) -> tuple[int, ...]:
    if tp == 1 or t.tp_dim is None:
        return t.shape
    shape = list(t.shape)
    shape[t.tp_dim] = chunk_rows(shape[t.tp_dim], tp, tp_rank)
    return tuple(shape)


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Decoder layers of pipeline stage `stage` (contiguous; earlier stages take any remainder)."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def stage_tensors(spec: ModelSpec, training: Training, pp: int, stage: int) -> list[tuple[TensorSpec, bool]]:
    """(tensor, trainable) held by pipeline stage `stage` (the whole model when pp == 1)."""
    layers = stage_layers(spec.num_layers, pp, stage)
    first, last = stage == 0, stage == pp - 1
    full = training.method == "full"
    out = []
    for t in spec.tensors():
        if t.layer is not None:
            keep = t.layer in layers
        elif t.kind == "embed":
            keep = first or (last and spec.tie_word_embeddings)  # a tied lm_head: a copy per end
        else:
            keep = last
        if keep:
            out.append((t, full))
    if training.lora:
        out += [
            (t, True)
            for t in spec.lora_tensors(training.lora_rank, training.lora_targets)
            if t.layer in layers
        ]
    return out


@dataclass
class StateBytes:
    params: int = 0
    grads: int = 0
    optimizer: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def _param_element_bytes(t: TensorSpec, training: Training) -> float:
    if training.method == "qlora" and t.kind == "linear":
        return nf4_bytes(t.numel, training.quant) / t.numel
    if t.kind in ("lora_A", "lora_B"):
        return training.adapter_bytes
    return training.precision.param


def _trained_element_bytes(t: TensorSpec, training: Training) -> tuple[int, int]:
    """(gradient, optimizer state) bytes per element of a trainable tensor.

    fp32 adapters carry fp32 gradients and fp32 AdamW moments and need no master copy: 4 + 8
    bytes, whatever the base's precision (adapters as light as 16-bit follow the precision).
    """
    p = training.precision
    if t.kind in ("lora_A", "lora_B") and training.adapter_bytes == 4:
        return 4, 8
    return p.grad, 2 * p.state + p.master


def state_bytes(
    spec: ModelSpec, training: Training, layout: Layout, dp_rank: int = 0, tp_rank: int = 0, stage: int = 0
) -> StateBytes:
    """Parameters, gradients and optimizer state held by one rank, in bytes (the counted storage).

    Exact for distft's strategies (checked against the wrapped models in tests/plan): FSDP2's
    padded parameter and gradient shards, the unpadded optimizer chunks, AdamW's step tensors.
    """
    out = StateBytes()
    for t, trainable in stage_tensors(spec, training, layout.pp, stage):
        shape = local_shape(t, layout.tp, tp_rank)
        numel = math.prod(shape)
        rest = numel // shape[0] if shape[0] else 0
        pbytes = _param_element_bytes(t, training)
        gbytes, obytes = _trained_element_bytes(t, training)
        if layout.shard == "full":
            padded_rows = math.ceil(shape[0] / layout.dp)
            out.params += math.ceil(padded_rows * rest * pbytes)
            if trainable:
                out.grads += padded_rows * rest * gbytes
                out.optimizer += chunk_rows(shape[0], layout.dp, dp_rank) * rest * obytes + STEP_BYTES
            continue
        out.params += math.ceil(numel * pbytes)
        if trainable:
            out.grads += numel * gbytes
            if layout.shard == "optimizer":  # ZeRO-1: a flat 1/N of every optimizer tensor
                out.optimizer += math.ceil(numel / layout.dp) * obytes + STEP_BYTES
            else:
                out.optimizer += numel * obytes + STEP_BYTES
    return out


def trainable_params(spec: ModelSpec, training: Training) -> int:
    if training.method == "full":
        return spec.num_params()
    return sum(t.numel for t in spec.lora_tensors(training.lora_rank, training.lora_targets))


# ---------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------


@dataclass
class Activations:
    saved: int  # bytes autograd keeps for backward at the peak (all in-flight micro-batches)
    transient: int  # working set on top: one layer's recompute (checkpointing) or the loss's logits
    per_layer: int  # one decoder layer, one micro-batch, not checkpointed
    inflight: int = 1  # micro-batches whose activations are alive at once (pipelines)
    detail: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.saved + self.transient


def _norm(tokens: int, width: int, rows: int, input_grad: bool, weight_trains: bool, c: int) -> int:
    """RMSNorm: fp32 upcast input + fp32 reciprocal RMS per row if the input needs a gradient;
    the normalised input (compute dtype) if the weight trains."""
    saved = (4 * tokens * width + 4 * rows) if input_grad else 0
    return saved + (c * tokens * width if weight_trains else 0)


def layer_activation_bytes(
    spec: ModelSpec, training: Training, layout: Layout, input_grad: bool = True
) -> tuple[int, bool]:
    """Bytes one decoder layer saves for backward on one rank, one micro-batch; and whether its
    output needs a gradient. `input_grad`: the residual stream entering it needs one (false only
    before the first adapter when the embeddings are frozen)."""
    c, a = training.precision.activation, training.adapter_bytes
    tp, sp = layout.tp, layout.sp and layout.tp > 1
    B, S = training.micro_batch, _seq(training, layout)
    T = B * S  # tokens inside attention and the MLP (the whole sequence, also under SP)
    Tn = T // tp if sp else T  # tokens of the residual stream and the norms on this rank
    h, d, r = spec.hidden_size, spec.head_dim, training.lora_rank
    nq, nkv, inter = spec.num_heads // tp, spec.num_kv_heads // tp, spec.intermediate_size // tp
    full = training.method == "full"
    lora = set(training.lora_targets) if training.lora else set()
    dropout = training.lora_dropout > 0
    # An adapter reads its projection's input as is (so shares it) only if nothing changes it first.
    # PEFT's LoRA layer casts the input to the adapter's dtype: with fp32 adapters over a bf16 base,
    # lora_A keeps its own copy (re-cast to bf16 under autocast). distft's Megatron layers (tp-sp)
    # do not cast, and dropout always makes a copy (plus a boolean mask).
    megatron = layout.tp > 1 and layout.tp_impl == "megatron"
    shares_input = not dropout and (a == c or megatron)
    a_saved = c if training.autocast else a  # dtype of what lora_A and lora_B keep

    def keeps_input(*names: str) -> bool:
        """The projections' (shared) input is kept: their weights train, or an adapter reads it as is."""
        return full or (shares_input and any(n in lora for n in names))

    shapes = spec.projection_shapes()

    def adapters(width: int, *names: str) -> int:
        """Per adapted projection: lora_A's own copy of the input (if not shared) and lora_B's input;
        under autocast, the compute-dtype casts of fp32 adapter weights, which backward reuses."""
        total = 0
        for n in names:
            if n in lora:
                if training.autocast and a != c:
                    out, inp = shapes[n]
                    column = n in COLUMN
                    total += c * r * (inp + out // tp if column else inp // tp + out)
                if dropout:
                    total += a_saved * T * width + T * width  # dropped-out copy and its boolean mask
                elif not shares_input:
                    total += a_saved * T * width  # the input cast to the adapter's dtype
                total += a_saved * T * r  # lora_A's output, kept by lora_B
        return total

    def adapted(*names: str) -> bool:
        return any(n in lora for n in names)

    total = 0
    # ---- attention block
    total += _norm(Tn, h, Tn, input_grad, full, c)
    n1_grad = input_grad or full
    if keeps_input("q_proj", "k_proj", "v_proj"):
        total += c * T * h  # the block input, kept by q/k/v: whole, also under SP (gathered)
    total += adapters(h, "q_proj", "k_proj", "v_proj")
    q_grad = n1_grad or adapted("q_proj")
    k_grad = n1_grad or adapted("k_proj")
    v_grad = n1_grad or adapted("v_proj")
    if spec.qk_norm:
        total += _norm(T, nq * d, T * nq, q_grad, full, c)
        total += _norm(T, nkv * d, T * nkv, k_grad, full, c)
    attn_grad = q_grad or k_grad or v_grad
    o_input = keeps_input("o_proj")
    if attn_grad:
        if training.attention == "eager":
            total += 3 * c * T * d * nq  # q (rotated); k and v repeated to every query head
            total += 4 * B * nq * S * S + (c * B * nq * S * S if c != 4 else 0)  # softmax fp32 (+ copy)
            if o_input:
                total += c * T * nq * d  # the output made contiguous for o_proj
        else:
            # transformers' attention sees the padding mask; distft's Megatron layer is causal only
            masked = training.has_padding_mask and not (layout.tp > 1 and layout.tp_impl == "megatron")
            # With a mask transformers repeats k and v to every head: a copy, unless this rank has a
            # single KV head (then the repeat is a stride-0 view of it).
            kv = nq if masked and nkv > 1 else nkv
            total += c * T * d * (2 * nq + 2 * kv) + 4 * T * nq  # q, k, v, output (o_proj's input); LSE
            if masked:
                total += c * B * S * S  # the additive mask, kept by sdpa
    elif o_input:
        total += c * T * nq * d
    total += adapters(nq * d, "o_proj")
    attn_out_grad = attn_grad or full or adapted("o_proj")
    residual_grad = input_grad or attn_out_grad
    # ---- MLP block
    total += _norm(Tn, h, Tn, residual_grad, full, c)
    n2_grad = residual_grad or full
    if keeps_input("gate_proj", "up_proj"):
        total += c * T * h
    total += adapters(h, "gate_proj", "up_proj")
    gate_grad = n2_grad or adapted("gate_proj")
    up_grad = n2_grad or adapted("up_proj")
    total += c * T * inter * (gate_grad + up_grad + gate_grad)  # SiLU input; SiLU output; up output
    if keeps_input("down_proj"):
        total += c * T * inter  # the product, kept by down_proj
    total += adapters(inter, "down_proj")
    return total, residual_grad or gate_grad or up_grad


def _seq(training: Training, layout: Layout) -> int:
    """Sequence length as the layers see it: TP+SP pads it to a multiple of the TP degree."""
    if layout.sp and layout.tp > 1:
        return math.ceil(training.seq_len / layout.tp) * layout.tp
    return training.seq_len


def inflight_microbatches(layout: Layout, stage: int) -> tuple[int, int]:
    """(micro-batch chunks alive at once on `stage`, layers per chunk divisor) for a pipeline.

    Returns the count of (micro-batch x chunk) activations alive at the peak and the number of
    chunks the stage's layers are cut into (1 except for interleaved schedules).
    """
    m, p = layout.microbatches, layout.pp
    if p == 1:
        return 1, 1
    if layout.schedule == "gpipe":
        return m, 1
    if layout.schedule == "1f1b":
        return min(m, p - stage), 1
    v = layout.virtual_stages
    rounds = max(1, m // p)
    per_round = m // rounds
    warmup = (v - 1) * per_round + 2 * (p - 1 - stage)
    return min(m * v, warmup + 1), v


def activation_bytes(spec: ModelSpec, training: Training, layout: Layout, stage: int = 0) -> Activations:
    """Activations one rank holds (the peak over a step), following the module docstring."""
    c = training.precision.activation
    tp = layout.tp
    sp = layout.sp and tp > 1
    B, S = training.micro_batch, _seq(training, layout)
    T = B * S
    Tn = T // tp if sp else T
    h, V = spec.hidden_size, spec.vocab_size
    full = training.method == "full"
    first, last = stage == 0, stage == layout.pp - 1
    layers = stage_layers(spec.num_layers, layout.pp, stage)

    detail: dict[str, int] = {}
    # Residual stream entering this stage needs a gradient unless the embeddings are frozen and
    # no adapter came before (LoRA's first layer). On later stages something earlier trained.
    grad = full or not first
    per_layer_max = 0
    layer_total = 0
    for _ in layers:
        saved, out_grad = layer_activation_bytes(spec, training, layout, grad)
        per_layer_max = max(per_layer_max, layer_activation_bytes(spec, training, layout, True)[0])
        layer_total += c * Tn * h if training.activation_checkpointing else saved
        grad = grad or out_grad
    detail["layers"] = layer_total
    if first and full:
        # Kept by the embedding for its weight gradient; under SP a view of the whole sequence's ids.
        detail["token ids"] = 8 * T
    # Rotary cos/sin, computed once per forward (per stage) on the whole sequence: (1, S, d) each.
    detail["rotary"] = 2 * c * S * spec.head_dim if layers else 0
    if last:
        per_seq = min(training.label_tokens, S // tp) if sp else min(training.label_tokens, S)
        n = B * per_seq  # labelled positions on this rank (SP: the rank holding the sequence's end)
        detail["final norm"] = _norm(Tn, h, Tn, grad, full, c)
        detail["loss"] = Tn + (c * n * h if full else 0) + 4 * n * V + 8 * n + 4
        loss_transient = n * V * (4 + (c if c != 4 else 0))  # logits, their fp32 copy
    else:
        loss_transient = 0
    one_microbatch = sum(detail.values())
    chunks, v = inflight_microbatches(layout, stage)
    inflight = chunks / v if layout.pp > 1 else 1  # in units of whole-stage micro-batches
    saved = math.ceil(one_microbatch * inflight)
    recompute = per_layer_max if training.activation_checkpointing else 0
    return Activations(
        saved=saved,
        transient=max(recompute, loss_transient),
        per_layer=per_layer_max,
        inflight=chunks,
        detail=detail,
    )


# ---------------------------------------------------------------------------------------------
# Communication and other transient buffers
# ---------------------------------------------------------------------------------------------

ZERO1_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's default reduce / all-gather bucket sizes


def comm_buffer_bytes(spec: ModelSpec, training: Training, layout: Layout, stage: int = 0) -> dict[str, int]:
    """Transient buffers at the peak of a step, by what they hold (bytes, one rank)."""
    p, c = training.precision, training.precision.activation
    tp = layout.tp
    out: dict[str, int] = {}
    held = stage_tensors(spec, training, layout.pp, stage)

    def unsharded(ts: list[tuple[TensorSpec, bool]], trainable_only: bool = False, grad: bool = False) -> int:
        total = 0.0
        for t, trains in ts:
            if trainable_only and not trains:
                continue
            numel = math.prod(local_shape(t, tp, 0))
            total += numel * (
                _trained_element_bytes(t, training)[0] if grad else _param_element_bytes(t, training)
            )
        return int(total)

    if layout.shard == "full" and layout.dp > 1:
        by_layer: dict[int | None, list[tuple[TensorSpec, bool]]] = {}
        for t, trains in held:
            by_layer.setdefault(t.layer, []).append((t, trains))
        root = by_layer.pop(None, [])
        layer_units = list(by_layer.values())
        biggest = max((unsharded(u) for u in layer_units), default=0)
        biggest_grad = max((unsharded(u, True, True) for u in layer_units), default=0)
        # FSDP2 keeps the root unit (embeddings, final norm, lm_head) gathered from forward to backward.
        gathered = unsharded(root)
        if layout.reshard_after_forward:
            gathered += (1 + layout.fsdp_prefetch) * biggest  # this layer and the prefetched ones
        else:
            gathered += sum(unsharded(u) for u in layer_units)  # ZeRO-2: every layer until backward
        out["gathered parameters"] = gathered
        out["unsharded gradients"] = 2 * biggest_grad + unsharded(root, True, True)
    if layout.shard == "optimizer" and layout.dp > 1:
        grads = unsharded(held, True, True)
        params = unsharded([(t, tr) for t, tr in held if tr])
        out["ZeRO-1 buckets"] = min(grads, ZERO1_BUCKET_ELEMENTS * p.grad) + min(
            params, ZERO1_BUCKET_ELEMENTS * p.param
        )
    if tp > 1:
        T = training.micro_batch * _seq(training, layout)
        out["TP collective buffers"] = 2 * c * T * spec.hidden_size
    if layout.pp > 1:
        out["pipeline send/recv"] = 2 * c * training.micro_batch * training.seq_len * spec.hidden_size
    if training.method == "qlora":
        biggest = (
            max(math.prod(local_shape(t, tp, 0)) for t, _ in held if t.kind == "linear")
            if any(t.kind == "linear" for t, _ in held)
            else 0
        )
        out["dequantized NF4 weight"] = c * biggest
    return out
