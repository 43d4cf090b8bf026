"""Ring attention (`parallel.cp_method=ring`): K and V passed from rank to rank, never gathered.

The all-gather form (`attention.py`) holds the whole row's K and V on every rank, per layer. The
ring holds two chunks' worth at a time: at step i of N, rank r attends with its own queries to the
K and V of rank r - i (mod N), while it sends what it holds to rank r + 1 and receives the next from
rank r - 1, so the transfer runs under the compute. Each step's scores are merged into the output
by their log-sum-exp (the softmax over all keys, assembled block by block, as FlashAttention does
over tiles):

    lse = log(exp(lse) + exp(lse_block)),   out = out exp(old lse - lse) + out_block exp(lse_block - lse)

Which blocks run. Rank r holds chunks r and 2N-1-r of 2N (`context/__init__.py`); a query chunk c
sees key chunk k < c whole, k = c causally (the diagonal), k > c not at all, so per step at most
three of the four (query chunk, key chunk) pairs compute, and every rank's total work is equal.

Backward runs the ring again: K and V go round once more, and beside them an fp32 accumulator of
their gradient, which every rank adds its queries' share to; one more hop brings each accumulator
home. With P = exp(S - lse) (S the scores) and D = rowsum(dO * O), per block:

    dV += P^T dO,   dS = P * (dO V^T - D),   dQ += dS K scale,   dK += dS^T Q scale

What moves per layer and micro-batch (K and V of 2L positions: 2 B Hkv 2L d elements): forward,
N-1 sends and receives of them (again where checkpointing recomputes the layer); backward, N-1
of them and N of their fp32 gradient accumulator (none where K and V need no gradient). Scores
are computed densely per block in fp32 here, which teaches the mechanism and runs on gloo and
NCCL alike; a fused kernel with a log-sum-exp output is what makes it fast on GPUs.

Paper: Liu, Zaharia, Abbeel, "Ring Attention with Blockwise Transformers" (2310.01889).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx


def chunks_of(rank: int, world: int) -> tuple[int, int]:
    """The two chunks of 2N a rank holds: its head r and the mirrored tail 2N-1-r."""
    return rank, 2 * world - 1 - rank


def _pass_on(tensors: list[torch.Tensor], shard) -> tuple[list[torch.Tensor], list]:
    """Send `tensors` to the next rank of the ring and receive the previous rank's: (buffers, works)."""
    group, rank, world = shard.group, shard.rank, shard.world
    after = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    before = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, after, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, before, group) for t in received]
    return received, dist.batch_isend_irecv(ops)


def _blocks(shard, source: int):
    """(local query half, source key half, diagonal?) of every pair of chunks that interact."""
    length, world = shard.chunk, shard.world
    for a, query_chunk in enumerate(shard.chunks):
        for b, key_chunk in enumerate(chunks_of(source, world)):
            if key_chunk <= query_chunk:
                yield (
                    slice(a * length, (a + 1) * length),
                    slice(b * length, (b + 1) * length),
                    (query_chunk, key_chunk),
                )


def _allowed(shard, chunks: tuple[int, int], device: torch.device) -> torch.Tensor | None:
    """Which (query, key) pairs of a block may attend: causal on the diagonal, same-document for
    packed rows; None: all of them."""
    (qc, kc), length = chunks, shard.chunk
    allowed = None
    if qc == kc:
        allowed = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    if shard.documents is not None:
        docs = shard.documents
        same = (
            docs[:, qc * length : (qc + 1) * length, None] == docs[:, None, kc * length : (kc + 1) * length]
        )
        allowed = same if allowed is None else same & allowed
    return None if allowed is None else allowed.view(-1, 1, 1, length, length)  # (1 or B, 1, 1, L, L)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, allowed) -> torch.Tensor:
    """(B, Hkv, G, L, L) fp32 scores of grouped queries (B, Hkv, G, L, d) against keys (B, Hkv, L, d)."""
    s = torch.einsum("bhgqd,bhkd->bhgqk", q.float(), k.float()) * scale
    return s if allowed is None else s.masked_fill(~allowed, float("-inf"))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard, scale: float):
        # q: (B, H, 2L, d) -> (B, Hkv, G, 2L, d): each KV head's group of query heads.
        batch, heads, positions, dim = q.shape
        grouped = q.view(batch, k.shape[1], heads // k.shape[1], positions, dim)
        out = torch.zeros(grouped.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(grouped.shape[:-1], float("-inf"), device=q.device)
        kv = [k.contiguous(), v.contiguous()]
        for step in range(shard.world):
            source = (shard.rank - step) % shard.world
            if step < shard.world - 1:
                received, works = _pass_on(kv, shard)
            for qs, ks, chunks in _blocks(shard, source):
                s = _scores(grouped[..., qs, :], kv[0][..., ks, :], scale, _allowed(shard, chunks, q.device))
                block = torch.logsumexp(s, dim=-1)  # (B, Hkv, G, L): -inf where a row sees no key
                p = torch.exp(s - block.nan_to_num(neginf=0.0)[..., None])
                block_out = torch.einsum("bhgqk,bhkd->bhgqd", p, kv[1][..., ks, :].float())
                merged = torch.logaddexp(lse[..., qs], block)  # -inf - -inf: a row with no key yet
                out[..., qs, :] = (
                    out[..., qs, :] * torch.exp(lse[..., qs] - merged).nan_to_num(0.0)[..., None]
                    + block_out * torch.exp(block - merged).nan_to_num(0.0)[..., None]
                )
                lse[..., qs] = merged
            if step < shard.world - 1:
                for work in works:
                    work.wait()
                kv = received
        ctx.save_for_backward(grouped, k, v, out, lse)
        ctx.shard, ctx.scale = shard, scale
        return out.to(q.dtype).view(q.shape)

    @staticmethod
    def backward(ctx: FunctionCtx, d_out: torch.Tensor):
        grouped, k, v, out, lse = ctx.saved_tensors
        shard, scale = ctx.shard, ctx.scale
        d_out = d_out.reshape(grouped.shape).float()
        delta = (d_out * out).sum(-1)  # D = rowsum(dO * O)
        dq = torch.zeros(grouped.shape, dtype=torch.float32, device=grouped.device)
        needs_kv = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        travelling = [k.contiguous(), v.contiguous()]
        if needs_kv:  # dK, dV of the K and V travelling with them, fp32
            travelling += [torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2)]
        for step in range(shard.world):
            source = (shard.rank - step) % shard.world
            key, value = travelling[0], travelling[1]
            for qs, ks, chunks in _blocks(shard, source):
                q_block, d_block = grouped[..., qs, :], d_out[..., qs, :]
                s = _scores(q_block, key[..., ks, :], scale, _allowed(shard, chunks, grouped.device))
                p = torch.exp(s - lse[..., qs, None])  # masked scores: exp(-inf) = 0
                dp = torch.einsum("bhgqd,bhkd->bhgqk", d_block, value[..., ks, :].float())
                ds = p * (dp - delta[..., qs, None])
                dq[..., qs, :] += torch.einsum("bhgqk,bhkd->bhgqd", ds, key[..., ks, :].float()) * scale
                if needs_kv:
                    travelling[2][..., ks, :] += (
                        torch.einsum("bhgqk,bhgqd->bhkd", ds, q_block.float()) * scale
                    )
                    travelling[3][..., ks, :] += torch.einsum("bhgqk,bhgqd->bhkd", p, d_block)
            # K and V go on while there is a rank they have not visited; the gradients one hop
            # further, home to the rank whose K and V they are.
            last = step == shard.world - 1
            moving = travelling[2:] if last else travelling
            if moving:
                received, works = _pass_on(moving, shard)
                for work in works:
                    work.wait()
                travelling = received if not last else [*travelling[:2], *received]
        dk = travelling[2].to(k.dtype) if needs_kv else None
        dv = travelling[3].to(v.dtype) if needs_kv else None
        return dq.to(grouped.dtype).view(*grouped.shape[:1], -1, *grouped.shape[-2:]), dk, dv, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard, scale: float) -> torch.Tensor:
    """(B, H, 2L, d) local queries against every rank's K and V, passed round the ring; (B, H, 2L, d)."""
    return _RingAttention.apply(q, k, v, shard, scale)
