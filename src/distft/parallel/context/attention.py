"""Context-parallel attention: local queries against keys and values all-gathered over the CP group.

Each rank holds two chunks of every row (`model.py`: chunk r and chunk 2N-1-r of 2N). Its q, k, v
are those of its own 2L positions. `gather_kv` is the one collective: forward all-gathers K and V
(stacked, one call) and puts the 2N chunks in sequence order; backward reduce-scatters dK and dV,
so each rank gets the sum over all ranks' queries of the gradient of its own keys and values.
`context_attention` then runs, per local chunk c (positions [cL, (c+1)L)), one SDPA of its L
queries against keys [0, (c+1)L): causal lower-right aligned, or a causal and same-document mask
for packed rows. It is registered with transformers as `CONTEXT`; the per-forward `ContextShard`
arrives as the `attention_mask` argument, the way `distft.model.attention` passes a `DocumentMask`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import FunctionCtx
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface

from distft.parallel.context.ring import ring_attention
from distft.parallel.megatron.collectives import all_gather, reduce_scatter

CONTEXT = "distft_context"  # the name the CP attention is registered under in transformers


def natural_order(world: int) -> list[int]:
    """For each chunk c of the row, where it lies among the gathered chunks, which come rank by
    rank, each rank's (head, tail) = (r, 2N-1-r): chunk c < N at 2c, chunk c >= N at 2(2N-1-c)+1."""
    return [2 * c if c < world else 2 * (2 * world - 1 - c) + 1 for c in range(2 * world)]


def gathered_order(world: int) -> list[int]:
    """The inverse of `natural_order`: the chunk of the row at each gathered place."""
    return [g // 2 if g % 2 == 0 else 2 * world - 1 - g // 2 for g in range(2 * world)]


class _GatherKV(torch.autograd.Function):
    """Forward: all-gather K and V, in sequence order. Backward: reduce-scatter dK and dV."""

    @staticmethod
    def forward(ctx: FunctionCtx, k: torch.Tensor, v: torch.Tensor, group, world: int):
        # k, v: (B, Hkv, 2L, d), this rank's two chunks. Sequence first, so that the gather is
        # along dim 0 (gloo wants [N * n, ...], PITFALLS.md): (2L, 2, B, Hkv, d).
        kv = torch.stack([k, v]).permute(3, 0, 1, 2, 4)
        gathered = all_gather(kv, group)  # (N * 2L, 2, B, Hkv, d), rank by rank
        chunks = gathered.view(2 * world, -1, *kv.shape[1:])  # (2N, L, 2, B, Hkv, d)
        order = torch.tensor(natural_order(world), device=k.device)
        full = chunks.index_select(0, order).flatten(0, 1)  # (S, 2, B, Hkv, d), sequence order
        full = full.permute(1, 2, 3, 0, 4).contiguous()  # (2, B, Hkv, S, d): one storage for both
        ctx.group, ctx.world = group, world
        return full[0], full[1]

    @staticmethod
    def backward(ctx: FunctionCtx, dk: torch.Tensor, dv: torch.Tensor):
        world = ctx.world
        d = torch.stack([dk, dv]).permute(3, 0, 1, 2, 4)  # (S, 2, B, Hkv, d)
        chunks = d.reshape(2 * world, -1, *d.shape[1:])  # (2N, L, 2, B, Hkv, d)
        order = torch.tensor(gathered_order(world), device=dk.device)
        ranked = chunks.index_select(0, order).flatten(0, 1)  # rank by rank, as gathered
        mine = reduce_scatter(ranked, ctx.group)  # (2L, 2, B, Hkv, d): summed over every rank's queries
        mine = mine.permute(1, 2, 3, 0, 4)  # (2, B, Hkv, 2L, d)
        return mine[0], mine[1], None, None


def gather_kv(k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None, world: int):
    """(B, Hkv, 2L, d) local K and V -> (B, Hkv, S, d) of the whole row, in sequence order."""
    return _GatherKV.apply(k, v, group, world)


@dataclass(eq=False)
class ContextShard:
    """What one forward's attention needs to know about the split (passed as `attention_mask`)."""

    group: dist.ProcessGroup | None
    rank: int
    world: int  # N
    chunk: int  # L: positions per chunk; the row (padded) has 2N of them
    chunks: tuple[int, int]  # this rank's chunks: (r, 2N-1-r)
    documents: torch.Tensor | None  # (B, S) document of every position of the row; None: one
    method: str = "allgather"  # parallel.cp_method: allgather (here) or ring (`ring.py`)
    _masks: dict = field(default_factory=dict)  # built on the first layer, shared by all

    def mask(self, i: int, query: torch.Tensor) -> object:
        """`attn_mask` of local chunk i's SDPA (None: plain causal). Built once per forward: as an
        additive float mask on the CPU, whose SDPA would otherwise turn a bool mask into a float
        copy in every layer, and keep each copy for backward."""
        key = (i, query.dtype)
        if key not in self._masks:
            self._masks[key] = self._build(i, query)
        return self._masks[key]

    def _build(self, i: int, query: torch.Tensor) -> object:
        c, length = self.chunks[i], self.chunk
        end = (c + 1) * length
        if self.documents is None:
            if c == 0:
                return None  # L queries against L keys: plain causal (is_causal)
            if query.device.type == "cuda":
                return causal_lower_right(length, end)  # flash / efficient kernels, no tensor
        q = torch.arange(c * length, end, device=query.device)
        allowed = q[:, None] >= torch.arange(end, device=query.device)[None, :]  # (L, (c+1)L)
        if self.documents is not None:  # and only inside one's own document
            docs = self.documents
            allowed = allowed & (docs[:, c * length : end, None] == docs[:, None, :end])  # (B, L, (c+1)L)
        allowed = allowed.view(-1, 1, *allowed.shape[-2:])  # (1 or B, 1, L, (c+1)L): heads broadcast
        if query.device.type == "cuda":
            return allowed
        return torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~allowed, float("-inf")
        )


def context_attention(
    module: nn.Module,
    query: torch.Tensor,  # (B, Hq, 2L, d): this rank's two chunks, rotary at global positions
    key: torch.Tensor,  # (B, Hkv, 2L, d)
    value: torch.Tensor,
    attention_mask: ContextShard,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns (B, 2L, Hq, d)."""
    shard = attention_mask
    if not isinstance(shard, ContextShard):
        raise TypeError(f"{CONTEXT} attention runs inside `ContextParallelLM` only, got {type(shard)}")
    if shard.method == "ring":
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return ring_attention(query, key, value, shard, scale).transpose(1, 2).contiguous(), None
    key, value = gather_kv(key, value, shard.group, shard.world)  # (B, Hkv, S, d)
    length, outs = shard.chunk, []
    for i, c in enumerate(shard.chunks):
        end = (c + 1) * length  # chunk c sees keys [0, (c+1)L)
        mask = shard.mask(i, query)
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, i * length : (i + 1) * length],
                key[:, :, :end],
                value[:, :, :end],
                attn_mask=mask,
                is_causal=mask is None,
                dropout_p=dropout,
                scale=scaling,
                enable_gqa=True,  # K/V heads never repeated
            )
        )
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


@functools.cache
def register() -> None:
    """Make `CONTEXT` an attention implementation transformers knows, once."""
    AttentionInterface.register(CONTEXT, context_attention)
