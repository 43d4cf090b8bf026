"""Attention kernels behind one switch, `model.attn_implementation`, chosen once per run.

A packed row (docs/packing.md) holds several documents end to end; each must attend to itself
alone, causally. The naive way, a dense (T, T) block-diagonal boolean mask, rules out every fast
kernel on CUDA (flash and cuDNN take no arbitrary mask) and spends T² work on positions that are
masked anyway. The choices:

- `flex` (distft's default off CUDA-with-flash-attn): a row of several documents runs PyTorch's
  FlexAttention with a *document block mask* (`document_block_mask`): per 128 x 128 tile, whether
  it is skipped (different documents), full (one document, strictly below the diagonal) or partial
  (the diagonal tiles and document boundaries, where the element-wise rule `same document and
  q >= kv` runs). It is built from the position ids' restarts on the device, in O((T/128)²), with
  no host sync and no T x T tensor. A row of one document runs plain causal SDPA with
  `enable_gqa` (flash or cuDNN on CUDA; K/V heads are never repeated). Inside compiled blocks
  (`distft.model.compile`) flex is compiled with the block; eager on CUDA it runs compiled on its
  own. On the CPU, where FlexAttention has no backward and runs unfused, the same document-causal
  attention runs as one causal SDPA per document (`_per_document_sdpa`).
- `flash`: transformers' `flash_attention_2` (the `flash-attn` package, CUDA, bf16/fp16), whose
  varlen kernel reads document boundaries from the position ids.
- `sdpa`: transformers' SDPA, a dense block-diagonal mask for packed rows (kept for comparison).
- `eager`: transformers' reference matmul-softmax attention.
- `auto`: `flash` where it can run, else `flex`. The choice is printed in the header and recorded
  in `metrics.jsonl` (`attention`).

Padded batches (`data.packing=false`) carry a 2-D padding mask; under `flex` they get a block mask
too (causal and padding), built by transformers from its mask function.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    AttentionMaskInterface,
    causal_mask_function,
    flex_attention_mask,
    sdpa_mask,
)

from distft.model.families import layer_types
from distft.tensors import document_ids

FLEX = "distft_flex"  # the name distft's flex path is registered under in transformers
TILE = 128  # FlexAttention's default block (tile) size
_TRANSFORMERS_NAMES = {"flex": FLEX, "flash": "flash_attention_2", "sdpa": "sdpa", "eager": "eager"}


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attention(choice: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """The kernel `choice` runs as on `device` in `dtype`: flex, flash, sdpa or eager."""
    if choice != "auto":
        return choice
    half = dtype in (torch.bfloat16, torch.float16)
    return "flash" if torch.device(device).type == "cuda" and half and flash_attn_installed() else "flex"


def transformers_name(kernel: str) -> str:
    """The `attn_implementation` transformers is given for `kernel` (`resolve_attention`)."""
    register()
    return _TRANSFORMERS_NAMES[kernel]


# ---- the document block mask ---------------------------------------------------------------


def document_block_mask(docs: torch.Tensor, tile: int = TILE) -> BlockMask:
    """The causal, document-aware BlockMask of packed rows, from the document index of every
    position (`docs`: (batch, seq), `distft.tensors.document_ids`).

    Documents are contiguous and their ids never decrease along a row, so for query tile i and key
    tile j <= i: they share a document iff the last document of j is >= the first of i, and the
    tile is *full* (every pair allowed, no element-wise check) iff j < i and both tiles lie inside
    one document (first document of j == last document of i).
    """
    batch, seq = docs.shape
    n = -(-seq // tile)
    # The last tile's tail continues the last document (an integer pad, valid on every device).
    tiles = torch.cat([docs, docs[:, -1:].expand(batch, n * tile - seq)], dim=1).view(batch, n, tile)
    first, last = tiles[..., 0], tiles[..., -1]  # (batch, n)
    q, kv = torch.arange(n, device=docs.device)[:, None], torch.arange(n, device=docs.device)[None, :]
    shares = (kv <= q) & (last[:, None, :] >= first[:, :, None])  # (batch, n_q, n_kv)
    full = (kv < q) & (first[:, None, :] == last[:, :, None])
    partial = shares & ~full

    def kv_blocks(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Kept tiles first, in key order (a stable sort of "not kept"): the layout flex reads.
        indices = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
        return keep.sum(-1, dtype=torch.int32)[:, None], indices[:, None]  # (batch, 1, n), (batch, 1, n, n)

    padded = tiles.view(batch, n * tile)  # indices in a partial last tile stay in range

    def document_causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor):
        return (padded[b, q_idx] == padded[b, kv_idx]) & (q_idx >= kv_idx)

    return BlockMask.from_kv_blocks(
        *kv_blocks(partial),
        *kv_blocks(full),
        BLOCK_SIZE=tile,
        mask_mod=document_causal,
        seq_lengths=(seq, seq),
    )


@dataclass(frozen=True)
class DocumentMask:
    """A packed row's mask under `flex`: the document index of every position, and where
    FlexAttention runs (`flex_runs_on`) the block mask built from it; the CPU splits by the
    documents instead (`_per_document_sdpa`) and builds none."""

    documents: torch.Tensor  # (batch, seq)
    block_mask: BlockMask | None


def packed_attention_masks(config, position_ids: torch.Tensor | None) -> dict:
    """What `LossLM` hands the backbone for a packed row under `flex`: one mask per layer type,
    so transformers builds none (and runs none of its host-syncing packed-row checks). No position
    ids (a row of one document): None, plain causal attention."""
    mask = None
    if position_ids is not None:
        docs = document_ids(position_ids)
        mask = DocumentMask(docs, document_block_mask(docs) if flex_runs_on(docs.device) else None)
    return {kind: mask for kind in set(layer_types(config))}


# ---- the kernel ------------------------------------------------------------------------------


@functools.cache
def _compiled_flex() -> Callable:
    # FlexAttention is fast only compiled; inside a compiled block dynamo traces the plain one.
    # Eager blocks on CUDA (TP strategies, a compile fallback) call this one: rows come in length
    # buckets there too, and the second length makes the length dynamic (one graph after it).
    return torch.compile(flex_attention)


def _flex(query, key, value, block_mask: BlockMask, scale: float | None) -> torch.Tensor:
    if torch.compiler.is_compiling():  # inside a compiled block: traced into its graph
        fn = flex_attention
    elif query.device.type == "cuda":
        fn = _compiled_flex()
    else:  # eager off CUDA (a test of the kernel itself): unfused, and it would say so
        fn = _eager_flex_quietly
    return fn(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=True)


def _eager_flex_quietly(*args, **kwargs) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)


def flex_runs_on(device: torch.device) -> bool:
    """FlexAttention is the CUDA kernel. On the CPU it has no backward (torch 2.13) and runs unfused
    (every score of the row materialised), so the CPU takes one causal SDPA per document instead."""
    return device.type != "cpu"


@torch.compiler.disable  # document lengths are data: one graph for every packing, eager here
def _per_document_sdpa(query, key, value, documents: torch.Tensor, scale: float | None) -> torch.Tensor:
    """The document-causal attention of one packed row (batch 1) as one causal SDPA per document:
    the CPU's path (`flex_runs_on`)."""
    lengths = torch.unique_consecutive(documents[0], return_counts=True)[1].tolist()  # host tensor
    parts = zip(*(t.split(lengths, dim=2) for t in (query, key, value)), strict=True)
    outs = [
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        for q, k, v in parts
    ]
    return torch.cat(outs, dim=2)


def flex_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # (batch, q_heads, seq, head_dim)
    key: torch.Tensor,  # (batch, kv_heads, seq, head_dim)
    value: torch.Tensor,
    attention_mask: DocumentMask | BlockMask | torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns (batch, seq, q_heads, head_dim)."""
    if isinstance(attention_mask, DocumentMask):
        if flex_runs_on(query.device):
            out = _flex(query, key, value, attention_mask.block_mask, scaling)
        else:
            out = _per_document_sdpa(query, key, value, attention_mask.documents, scaling)
    elif isinstance(attention_mask, BlockMask):
        out = _flex(query, key, value, attention_mask, scaling)
    elif attention_mask is None:  # one document per row (training) or a decode step (q_len 1)
        # Literal is_causal (SDPA takes no symbolic bool under compile); the branch is a guard.
        # A decode step's query (q_len 1 < kv_len) attends to every cached key.
        causal = True if query.shape[2] == key.shape[2] else False  # noqa: SIM210
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=causal, scale=scaling, dropout_p=dropout, enable_gqa=True
        )
    else:  # a dense mask (padded rows on the CPU, generation with a cache): transformers' SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return out.transpose(1, 2).contiguous(), None


def flex_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    **kwargs,
) -> BlockMask | torch.Tensor | None:
    """The mask transformers builds for `FLEX` when the caller passed none ready-made (padded
    batches, generation): None where plain causal attention is exact; on CUDA transformers' block
    mask (built compiled); on the CPU, which has no FlexAttention backward, its dense SDPA mask."""
    plain = mask_function is causal_mask_function and attention_mask is None
    if plain and q_length == kv_length and not q_offset and not kv_offset:
        return None
    if torch.device(device).type == "cuda" and q_length == kv_length:
        return flex_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                                   attention_mask, device=device)  # fmt: skip
    # transformers' own: None (causal SDPA) where the padding mask is all ones.
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                     device=device, **kwargs)  # fmt: skip


@functools.cache
def register() -> None:
    """Make `FLEX` an attention implementation transformers knows (kernel and mask), once."""
    AttentionInterface.register(FLEX, flex_attention_forward)
    AttentionMaskInterface.register(FLEX, flex_mask)
