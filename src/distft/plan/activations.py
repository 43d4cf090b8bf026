"""Activations: what autograd saves for backward on one rank, per layer and per pipeline stage.

The activation model, per decoder layer and micro-batch (T = batch x seq tokens, h hidden,
I MLP width, nq/nkv query/KV heads of d, c bytes of the compute dtype, r the LoRA rank). Each
term is a tensor autograd keeps, counted once even when several ops save it:
- RMSNorm (input_layernorm, post_attention_layernorm, and Qwen3's q_norm, k_norm; the llama,
  qwen2 and mistral families have no q/k norm, `ModelSpec.qk_norm`): the fp32 upcast input
  (4 T w) and the fp32 reciprocal RMS (4 T per row) when its input needs a gradient; with a
  trainable weight also the normalised input in the compute dtype (c T w). The norm's output is
  kept by the projections that read it when their weights (or LoRA adapters) train: c T h once.
- attention: q, k, v, the output and the log-sum-exp, or the scores, per kernel and device
  (`plan/attention.py`: CUDA's kernels keep less than the CPU's SDPA paths).
- MLP: gate output, SiLU output, up output and their product (4 c T I); an MoE block's router
  and routed rows are `plan/experts.py`'s.
- biases (Qwen2's q/k/v): nothing; a bias's gradient is its output's gradient, summed over tokens.
- LoRA: each adapted projection keeps lora_A's output (T r). lora_A's input is the projection's
  input, shared, when adapters and activations have the same dtype; PEFT casts the input to the
  adapters' fp32, so over a bf16 base each adapter keeps its own copy of its input (4 T in, or
  c T in under bf16 autocast, which also keeps bf16 casts of the adapter weights). LoRA dropout
  makes a copy too, plus a boolean mask. distft's Megatron layers (tp-sp) do not cast.
- outside the layers: token ids (8 T, full finetuning), rotary cos/sin (2 c S d, S a packed row's
  B x S), context parallelism's CPU masks (`plan/attention.py`), the loss mask
  (T bytes), the final norm, lm_head's input (c n h, full finetuning) and the fp32 log-softmax
  (4 n V) over the n labelled positions (distft computes logits only where there is a loss).
  Past 1 GiB of such logits the head is chunked (`distft.model.loss`): it keeps the gradient of
  its input (c n h) and, when it trains, of its weight (V h), and one chunk's logits at a time.

Under TP everything inside attention and the MLP is divided by the TP degree (heads and MLP
columns are split) while the norms, the residual stream and the projections' inputs stay whole.
Sequence parallelism also splits what lies between the blocks (norms, residual, loss) along the
sequence; the all-gathered block inputs that column projections keep are still whole. Activation
checkpointing (`full`) keeps each layer's input only (c T h) and recomputes one layer at a time in
backward; `selective` keeps everything but the MLP module's internals (its input, c T h, instead)
and recomputes one MLP at a time (a tiled MLP, `mlp_tiles` = k: the same, a k-th of an MLP's
internals at a time, whatever the level); `offload` keeps the layer inputs in host memory (`host`) and
brings one back per layer recomputed. A pipeline stage holds its own layers' activations for every micro-batch in flight:
GPipe m, 1F1B min(m, p - s) (torch's `Schedule1F1B` warms stage s up with that many forwards),
interleaved 1F1B (v chunks per rank) min(m v, (v - 1) m' + 2 (p - 1 - s) + 1) chunks, m' the
micro-batches per round; the first stage holds the most. A rank holds the layers of the stages
the runtime places on it (`distft.parallel.pipeline.Layout`).

FSDP x TP (`fsdp+tp`) is plain TP inside (`parallelize_module`, no sequence parallelism), as the
runtime builds it: only `tp-sp` splits the residual stream along the sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from distft.model.loss import loss_chunk
from distft.parallel.context.model import padded_length
from distft.parallel.pipeline.cost import MLP_PROJECTIONS
from distft.plan.attention import attention_bytes, context_masks
from distft.plan.experts import moe_block_bytes
from distft.plan.inputs import Parallelism, Training, holds_first_stage, holds_last_stage, rank_layers
from distft.plan.memory import layer_seq_len
from distft.plan.model_spec import COLUMN, ModelSpec


@dataclass
class Activations:
    saved: int  # bytes autograd keeps for backward at the peak (all in-flight micro-batches)
    transient: int  # working set on top: one layer's recompute (checkpointing) or the loss's logits
    per_layer: int  # one decoder layer, one micro-batch, not checkpointed
    inflight: int = 1  # micro-batches whose activations are alive at once (pipelines)
    detail: dict[str, int] = field(default_factory=dict)
    host: int = 0  # offloaded checkpoints: in host memory from forward to backward

    @property
    def total(self) -> int:
        return self.saved + self.transient


def _norm(tokens: int, width: int, rows: int, input_grad: bool, weight_trains: bool, c: int) -> int:
    """RMSNorm: fp32 upcast input + fp32 reciprocal RMS per row if the input needs a gradient;
    the normalised input (compute dtype) if the weight trains."""
    saved = (4 * tokens * width + 4 * rows) if input_grad else 0
    return saved + (c * tokens * width if weight_trains else 0)


@dataclass(frozen=True)
class _Layer:
    """The sizes one decoder layer works with on one rank (see the module docstring's symbols)."""

    spec: ModelSpec
    training: Training
    par: Parallelism

    @property
    def megatron(self) -> bool:
        return self.par.tp > 1 and self.par.tensor_parallel == "megatron"

    @property
    def rows(self) -> tuple[int, int]:  # (rows, positions) of a micro-batch: a packed one is one row
        t = self.training
        return (1, t.micro_batch * t.seq_len) if t.packed else (t.micro_batch, t.seq_len)

    @property
    def T(self) -> int:  # tokens inside attention and the MLP (the whole sequence, also under SP)
        if self.par.cp > 1:  # context parallelism: this rank's head and tail chunks
            rows, seq = self.rows
            return rows * padded_length(seq, self.par.cp) // self.par.cp
        return self.training.micro_batch * layer_seq_len(self.training, self.par)

    @property
    def kv_tokens(self) -> int:  # the keys and values attention keeps: CP's all-gathered, the ring's its own
        if self.par.cp > 1 and self.par.cp_method != "ring":
            rows, seq = self.rows
            return rows * padded_length(seq, self.par.cp)
        return self.T

    @property
    def Tn(self) -> int:  # tokens of the residual stream and the norms on this rank
        return self.T // self.par.tp if self.par.sp and self.par.tp > 1 else self.T

    @property
    def lora(self) -> set[str]:
        return set(self.training.lora_targets) if self.training.lora else set()

    @property
    def shares_input(self) -> bool:
        """An adapter reads its projection's input as is (so shares it) only if nothing changes it
        first. PEFT's LoRA layer casts the input to the adapter's dtype: with fp32 adapters over a
        bf16 base, lora_A keeps its own copy (re-cast to bf16 under autocast). distft's Megatron
        layers (tp-sp) do not cast, and dropout always makes a copy (plus a boolean mask)."""
        t = self.training
        return t.lora_dropout <= 0 and (t.adapter_bytes == t.precision.activation or self.megatron)

    def keeps_input(self, *names: str) -> bool:
        """The projections' (shared) input is kept: their weights train, or an adapter reads it as is."""
        return self.training.method == "full" or (self.shares_input and any(n in self.lora for n in names))

    def adapted(self, *names: str) -> bool:
        return any(n in self.lora for n in names)

    def adapters(self, width: int, *names: str) -> int:
        """Per adapted projection: lora_A's own copy of the input (if not shared) and lora_B's input;
        under autocast, the compute-dtype casts of fp32 adapter weights, which backward reuses."""
        t, tp, T = self.training, self.par.tp, self.T
        c, a, r = t.precision.activation, t.adapter_bytes, t.lora_rank
        a_saved = c if t.autocast else a  # dtype of what lora_A and lora_B keep
        shapes = self.spec.projection_shapes()
        total = 0
        for n in names:
            if n not in self.lora:
                continue
            if t.autocast and a != c:
                out, inp = shapes[n]
                total += c * r * (inp + out // tp if n in COLUMN else inp // tp + out)
            if t.lora_dropout > 0:
                total += a_saved * T * width + T * width  # dropped-out copy and its boolean mask
            elif not self.shares_input:
                total += a_saved * T * width  # the input cast to the adapter's dtype
            total += a_saved * T * r  # lora_A's output, kept by lora_B
        return total


def _attention_block(x: _Layer, input_grad: bool) -> tuple[int, bool]:
    """Bytes the attention half of a layer keeps, and whether its output needs a gradient."""
    spec, t = x.spec, x.training
    c, h, d, T, Tn = t.precision.activation, spec.hidden_size, spec.head_dim, x.T, x.Tn
    nq, nkv = spec.num_heads // x.par.tp, spec.num_kv_heads // x.par.tp
    full = t.method == "full"
    total = _norm(Tn, h, Tn, input_grad, full, c)
    n1_grad = input_grad or full
    if x.keeps_input("q_proj", "k_proj", "v_proj"):
        total += c * T * h  # the block input, kept by q/k/v: whole, also under SP (gathered)
    total += x.adapters(h, "q_proj", "k_proj", "v_proj")
    q_grad, k_grad = n1_grad or x.adapted("q_proj"), n1_grad or x.adapted("k_proj")
    v_grad = n1_grad or x.adapted("v_proj")
    if spec.qk_norm:
        total += _norm(T, nq * d, T * nq, q_grad, full, c)
        total += _norm(T, nkv * d, T * nkv, k_grad, full, c)
    attn_grad = q_grad or k_grad or v_grad
    o_input = x.keeps_input("o_proj")
    if attn_grad:
        total += attention_bytes(spec, t, x.par, T, x.kv_tokens, o_input)
    elif o_input:
        total += c * T * nq * d
    total += x.adapters(nq * d, "o_proj")
    return total, attn_grad or full or x.adapted("o_proj")


def _mlp_block(x: _Layer, residual_grad: bool) -> tuple[int, int, bool]:
    """Bytes the MLP half of a layer keeps: its norm's, the MLP module's (what selective
    checkpointing recomputes); and whether its output needs a gradient."""
    spec, t = x.spec, x.training
    c, h, T, Tn = t.precision.activation, spec.hidden_size, x.T, x.Tn
    inter = spec.intermediate_size // x.par.tp
    full = t.method == "full"
    norm = _norm(Tn, h, Tn, residual_grad, full, c)
    n2_grad = residual_grad or full
    if spec.moe:  # the router and the experts (`plan/experts.py`)
        return norm, moe_block_bytes(spec, t, x.par, T), n2_grad or bool(x.lora & set(MLP_PROJECTIONS))
    total = 0
    if x.keeps_input("gate_proj", "up_proj"):
        total += c * T * h
    total += x.adapters(h, "gate_proj", "up_proj")
    gate_grad, up_grad = n2_grad or x.adapted("gate_proj"), n2_grad or x.adapted("up_proj")
    total += c * T * inter * (gate_grad + up_grad + gate_grad)  # SiLU input; SiLU output; up output
    if x.keeps_input("down_proj"):
        total += c * T * inter  # the product, kept by down_proj
    total += x.adapters(inter, "down_proj")
    return norm, total, gate_grad or up_grad


def layer_activation_bytes(
    spec: ModelSpec, training: Training, par: Parallelism, input_grad: bool = True, level: str = "none"
) -> tuple[int, bool]:
    """Bytes one decoder layer saves for backward on one rank, one micro-batch, at checkpointing
    `level` none or selective (the MLP module keeps its input only); and whether its output needs
    a gradient. `input_grad`: the residual stream entering it needs one (false only before the
    first adapter when the embeddings are frozen)."""
    x = _Layer(spec, training, par)
    attn, attn_out_grad = _attention_block(x, input_grad)
    residual_grad = input_grad or attn_out_grad
    norm, mlp, mlp_grad = _mlp_block(x, residual_grad)
    if level == "selective":
        mlp = training.precision.activation * x.T * spec.hidden_size  # the norm's output, its input
    return attn + norm + mlp, residual_grad or mlp_grad


def inflight_microbatches(par: Parallelism, stage: int) -> tuple[int, int]:
    """(micro-batch chunks alive at once on pipeline rank `stage`, chunks per micro-batch).

    Returns the count of (micro-batch x chunk) activations alive at the peak and the number of
    chunks the rank's layers are cut into (V, the runtime's stages per rank).
    """
    m, p = par.microbatches, par.pp
    if p == 1:
        return 1, 1
    if par.schedule == "gpipe":
        return m, 1
    if par.schedule == "1f1b":
        return min(m, p - stage), 1
    v = par.virtual_stages
    rounds = max(1, m // p)
    per_round = m // rounds
    warmup = (v - 1) * per_round + 2 * (p - 1 - stage)
    return min(m * v, warmup + 1), v


def _packed_context_labels(t: Training, cp: int) -> float:
    """Labelled positions on the fullest context-parallel rank of a packed row: each document's
    last `label_tokens` positions but its very last (which predicts nothing), in the row's 2N
    chunks, of which rank r holds r and 2N-1-r. (A row of one document has them in its tail: rank 0.)"""
    docs, seq = t.micro_batch, t.seq_len
    length = padded_length(docs * seq, cp) // (2 * cp)
    spans = [(max(d * seq, (d + 1) * seq - 1 - t.label_tokens), (d + 1) * seq - 1) for d in range(docs)]

    def held(rank: int) -> float:
        chunks = [(c * length, (c + 1) * length) for c in (rank, 2 * cp - 1 - rank)]
        return sum(max(0, min(b, hi) - max(a, lo)) for a, b in spans for lo, hi in chunks)

    return max(held(rank) for rank in range(cp))


def _outside_layers(
    x: _Layer, first: bool, last: bool, grad: bool, has_layers: bool
) -> tuple[dict[str, int], int]:
    """Token ids, rotary tables, final norm and loss on this rank; and the loss's transient logits."""
    t, spec, tp = x.training, x.spec, x.par.tp
    c, B, S, h = t.precision.activation, t.micro_batch, layer_seq_len(t, x.par), spec.hidden_size
    T, Tn = x.T, x.Tn
    if x.par.cp > 1:  # context parallelism: this rank's positions only
        S = T // B
    full = t.method == "full"
    detail: dict[str, int] = {}
    if first and full:
        # Kept by the embedding for its weight gradient; under SP a view of the whole sequence's ids.
        detail["token ids"] = 8 * T
    # Rotary cos/sin, computed once per forward (per stage) on the whole row: (1, S, d) each.
    row = T if x.par.cp > 1 and t.packed else S * (B if t.packed else 1)
    detail["rotary"] = 2 * c * row * spec.head_dim if has_layers else 0
    if has_layers and (masks := context_masks(t, x.par)):
        detail["attention masks"] = masks
    if not last:
        return detail, 0
    sp = x.par.sp and tp > 1
    per_seq = min(t.label_tokens, S // tp) if sp else min(t.label_tokens, S)
    n = B * per_seq  # labelled positions on this rank (SP: the rank holding the sequence's end)
    if x.par.cp > 1 and t.packed and B > 1:  # B documents in a row (a running step's row: its count)
        n = _packed_context_labels(t, x.par.cp)
    detail["final norm"] = _norm(Tn, h, Tn, grad, full, c)
    V = spec.vocab_size
    chunk = loss_chunk(n, V)
    if chunk is None:  # the plain head: the labelled positions' logits
        detail["loss"] = Tn + (c * n * h if full else 0) + 4 * n * V + 8 * n + 4
        return detail, n * V * (4 + (c if c != 4 else 0))  # logits, their fp32 copy
    # The chunked head (`distft.model.loss`) keeps the gradients it computed in forward: the hidden
    # states' (n, h) and, when it trains, the head's (V, h), accumulated in fp32 meanwhile.
    head = t.precision.param * V * h if full else 0
    detail["loss"] = Tn + c * n * h + head  # no logits, no labels kept
    return detail, chunk * V * (4 + (c if c != 4 else 0)) + (4 * V * h if full else 0)


def activation_bytes(spec: ModelSpec, training: Training, par: Parallelism, stage: int = 0) -> Activations:
    """Activations one rank holds (the peak over a step), following the module docstring."""
    x = _Layer(spec, training, par)
    first, last = holds_first_stage(par, stage), holds_last_stage(par, stage)
    layers = rank_layers(spec, training, par, stage)
    # Residual stream entering this rank needs a gradient unless the embeddings are frozen and
    # no adapter came before (LoRA's first layer). On later stages something earlier trained.
    grad = training.method == "full" or not first
    level, tiles = training.activation_checkpointing, max(1, training.mlp_tiles)
    # A tiled MLP keeps its input only, as selective checkpointing does (`model.mlp_tiles`).
    keeps = "selective" if tiles > 1 else "none"
    per_layer_max = layer_total = host = 0
    layer_input = training.precision.activation * x.Tn * spec.hidden_size  # what a checkpoint keeps
    for _ in layers:
        saved, out_grad = layer_activation_bytes(
            spec, training, par, grad, keeps if level == "none" else level
        )
        per_layer_max = max(per_layer_max, layer_activation_bytes(spec, training, par, True)[0])
        if level in ("none", "selective"):
            layer_total += saved
        elif level == "full":
            layer_total += layer_input
        else:  # offload: in host memory until backward
            host += layer_input
        grad = grad or out_grad
    outside, loss_transient = _outside_layers(x, first, last, grad, bool(layers))
    detail = {"layers": layer_total, **outside}
    chunks, v = inflight_microbatches(par, stage)
    inflight = chunks / v if par.pp > 1 else 1  # in units of whole-stage micro-batches
    # Backward rebuilds one MLP (a tiled one: one tile of it), or one layer at a time (offload:
    # with its input back from the host first).
    mlp = (_mlp_block(x, True)[1] if layers else 0) // tiles
    layer = per_layer_max if tiles == 1 else layer_activation_bytes(spec, training, par, True, keeps)[0] + mlp
    recompute = {
        "none": mlp if tiles > 1 else 0,
        "selective": mlp,
        "full": layer,
        "offload": layer + layer_input,
    }[level]
    return Activations(
        saved=math.ceil(sum(detail.values()) * inflight),
        transient=max(recompute, loss_transient),
        per_layer=per_layer_max,
        inflight=chunks,
        detail=detail,
        host=math.ceil(host * inflight),
    )
