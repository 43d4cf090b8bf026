"""Context parallelism (`cp`): every row's positions split over N ranks, K and V all-gathered.

What each rank holds. The whole model (replicated, as under DDP), the whole global batch's rows
(every rank reads the same rows), and 2/(2N) of every row's positions. A row of S tokens is padded
to a multiple of 2N (fill token 0, label -100, positions continuing the row: with causal attention
no real token sees them) and cut into 2N chunks of L = S/2N positions; rank r holds chunk r (the
head) and chunk 2N-1-r (the mirrored tail). N = 2, S = 8: rank 0 holds positions 0-1 and 6-7,
rank 1 holds 2-3 and 4-5. Everything computed per position (embedding, norms, projections, MLP,
the loss head) runs on those 2L positions only, so the activations per rank are ~1/N of one
process's. Position ids stay global: rotary embeddings use each local token's own position in
the row (packed rows: the batch's per-document positions, restarting at 0 at every document).

Why head and tail. Causal attention is lopsided: the queries of chunk c attend to c + 1 chunks of
keys (the last one half-masked), work ~ c + 1/2. Contiguous slices would give the last rank 2N - 1
times the first rank's attention work, and every rank waits for the slowest at each collective.
Chunks r and 2N-1-r cost (r + 1/2) + (2N-1-r + 1/2) = 2N whatever r: the same on every rank.

What moves, when (per layer, one micro-batch; B rows, Hkv key/value heads of size d):
- forward: each rank computes q, k, v of its own 2L positions; one all-gather of K and V stacked,
  (2, B, Hkv, 2L, d) from each rank, gives every rank K and V of the whole row, (2, B, Hkv, S, d),
  reordered from rank order into sequence order. Then per local chunk c, one SDPA of its L queries
  against keys [0, (c+1)L): causal aligned at the lower right (`causal_lower_right`), or for a
  packed row a mask that is causal and same-document. The two outputs are concatenated.
- backward: the all-gather's adjoint, one reduce-scatter of dK and dV (the same shape): each rank's
  queries contributed to the gradient of every key before them, and the reduce-scatter sums those
  contributions and hands each rank the part of its own positions.
- with `model.activation_checkpointing=full` or `offload` the layer's forward reruns in backward,
  and its all-gather with it; `selective` recomputes the MLP only, which communicates nothing.
- after the last micro-batch's backward: one all-reduce of every trainable gradient (flat), since
  each rank's gradient is its positions' share; and per step the loss sum (4 bytes).
Bytes per layer and micro-batch, each way: 2 B S Hkv d x bytes per element (K and V of the whole
row, S padded to a multiple of 2N), whatever N. What a rank keeps for backward is 1/N of one
process's activations plus that gathered K/V per layer, which attention saves (and on the CPU the
additive mask of each tail chunk, L x (c+1)L, built once per forward); `micro`, 4 rows of 512
tokens: 0.539 of one process's at N = 2, 0.284 at N = 4 (tests/parallel/test_context.py).

Padded batches are accepted right-padded only (checked, ValueError otherwise), and their mask is
dropped: a real token attends causally to real tokens only, padding carries no label.

The ring form (`parallel.cp_method=ring`, `ring.py`) passes each rank's K and V from rank to rank
instead, N-1 hops forward and again in backward beside their fp32 gradients, and merges the
blocks by their log-sum-exp: it never holds more than two ranks' worth of K and V.

Files: `attention.py` (the autograd gather and the per-chunk attention), `ring.py` (the ring), `model.py`
(`ContextParallelLM`: shards the rows, embeds the local tokens, runs the layers, the local loss),
`strategy.py` (`ContextParallel`: gradients summed, loss all-reduced). torch's own CP
(`torch.distributed.tensor.experimental.context_parallel`) does not train on the CPU (PITFALLS.md).

Papers: Liu et al., "Ring Attention" (2310.01889) for the sequence split; the all-gather of K/V
with 2N load-balanced chunks is Llama 3's (Dubey et al., 2407.21783, section 3.3.2).
"""

from __future__ import annotations

from distft.parallel.context.strategy import ContextParallel

__all__ = ["ContextParallel"]
