"""What attention keeps for backward, per kernel and per device (`Training.device`).

The kernel is `model.attn_implementation` as the run resolves it (`distft.model.attention`); what
it keeps differs between CUDA (what `distft plan --gpu` plans) and the CPU (a `distft train` on
this machine), per layer and micro-batch (T tokens, c bytes of the compute dtype, nq/nkv heads of
d, B rows of S):

- CUDA, flash and flex (and `auto`): q and k after rotary, v, the output (c T d (2nq + 2nkv)) and
  the fp32 log-sum-exp (4 T nq), whatever the padding: flex takes a block mask, flash none.
  `sdpa` with a padding mask: transformers expands k and v to all nq heads (a copy, unless there is
  one KV head: a view) and SDPA keeps the dense mask (c B S^2).
- The CPU: FlexAttention has no backward there, so `flex` and `auto` run torch's CPU flash SDPA,
  which keeps the same q, k, v, output and log-sum-exp. A padded batch goes through transformers'
  SDPA with its dense mask, as `sdpa`. A packed row (`Training.packed`) runs one SDPA per document
  and concatenates their outputs: o_proj keeps the concatenation, a copy beside the per-document
  outputs SDPA keeps (c T nq d more). `sdpa` on a packed row keeps the row's block-diagonal mask,
  c (B S)^2, with k and v expanded.
- Eager, both: the S x S scores, the fp32 softmax (4 B nq S^2) and its compute-dtype copy (c B nq
  S^2 unless c = 4), k and v repeated to every query head, the output's contiguous copy.
- Context parallelism (`distft.parallel.context`): the all-gather form keeps the whole row's K and
  V; on the CPU also o_proj's copy of the two chunks' concatenated outputs and, once per forward and
  shared by the layers, the additive masks of the local chunks (`context_masks`). The ring keeps its
  merged output in fp32 and hands o_proj a copy in the compute dtype, on either device.
"""

from __future__ import annotations

from distft.parallel.context.model import padded_length
from distft.plan.inputs import Parallelism, Training
from distft.plan.memory import layer_seq_len
from distft.plan.model_spec import ModelSpec


def on_cpu(training: Training) -> bool:
    return training.device == "cpu"


def _dense_mask(t: Training, par: Parallelism) -> int:
    """Bytes of the dense mask SDPA keeps per layer (0: none). distft's Megatron layer (tp-sp) and
    its context-parallel attention are causal only: right-padded rows need no mask."""
    if par.cp > 1 or (par.tp > 1 and par.tensor_parallel == "megatron"):
        return 0
    c, B, S = t.precision.activation, t.micro_batch, layer_seq_len(t, par)
    if not on_cpu(t):
        return c * B * S * S if t.has_padding_mask and t.attention == "sdpa" else 0
    if t.packed:  # the row's block-diagonal mask under sdpa; one SDPA per document under flex
        return c * (B * S) ** 2 if t.attention == "sdpa" else 0
    return c * B * S * S if t.has_padding_mask else 0  # flex runs transformers' SDPA there


def attention_bytes(
    spec: ModelSpec, t: Training, par: Parallelism, T: int, kv_tokens: int, o_input: bool
) -> int:
    """What attention itself keeps when its inputs need gradients (T query tokens, `kv_tokens` keys
    and values on this rank); `o_input`: o_proj keeps its input."""
    c, B, S = t.precision.activation, t.micro_batch, layer_seq_len(t, par)
    d, nq, nkv = spec.head_dim, spec.num_heads // par.tp, spec.num_kv_heads // par.tp
    if t.attention == "eager":
        total = 3 * c * T * d * nq  # q (rotated); k and v repeated to every query head
        total += 4 * B * nq * S * S + (c * B * nq * S * S if c != 4 else 0)  # softmax fp32 (+ copy)
        return total + (c * T * nq * d if o_input else 0)  # the output made contiguous for o_proj
    mask = _dense_mask(t, par)
    kv = nq if mask and nkv > 1 else nkv  # expanded with a mask: a copy, unless there is one (a view)
    ring = par.cp > 1 and par.cp_method == "ring"
    out = (4 + (c if o_input else 0) if ring else c) * T * nq * d
    # Outputs concatenated (flex's documents, or context parallelism's two chunks): o_proj keeps a copy.
    documents = t.packed and t.attention in ("flex", "auto")
    concatenated = on_cpu(t) and not ring and (documents or par.cp > 1)
    if concatenated and o_input:
        out += c * T * nq * d
    return c * d * (T * nq + 2 * kv_tokens * kv) + out + 4 * T * nq + mask  # q, k, v, out; LSE; mask


def context_masks(t: Training, par: Parallelism) -> int:
    """The CPU's additive masks of context parallelism's all-gather form, built once per forward and
    kept for backward (CUDA takes a lower-right causal flag, or a boolean mask: not counted): a local
    chunk c keeps L x (c+1)L, (2N+1) L^2 over a rank's head r and tail 2N-1-r (rank 0's head of
    a one-document row needs none: the fullest rank is counted). One per row of a packed batch
    (its documents), one shared by the rows otherwise."""
    if par.cp == 1 or par.cp_method == "ring" or not on_cpu(t):
        return 0
    n = par.cp
    seq = t.micro_batch * t.seq_len if t.packed else t.seq_len
    length = padded_length(seq, n) // (2 * n)
    return t.precision.activation * (2 * n + 1) * length * length
