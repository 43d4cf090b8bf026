"""The decoder forward under Megatron TP (+ SP), with every collective written out where it runs.

Activations run sequence-first, (seq, batch, hidden), as in Megatron-LM, so the sequence is dim 0
and every gather or scatter is a contiguous buffer. Sharded: each block's projections (`layers.py`);
with sequence parallelism (SP) also the residual stream *between* blocks: rank r holds positions
[r S/N, (r+1) S/N), and the embedding lookup, the residual adds, input_layernorm,
post_attention_layernorm, the final norm and the loss run on that shard only.

One decoder layer, one micro-batch (N = 2; AG all-gather, RS reduce-scatter, along the sequence):

    x (S/N,B,H) -> norm -> AG -> (S,B,H) -> q,k,v (column) -> attention on H/N heads -> o (row)
      -> partial (S,B,H) -> RS -> (S/N,B,H) -> + x -> norm -> AG -> gate,up (column) -> silu *
      -> down (row) -> partial (S,B,H) -> RS -> (S/N,B,H) -> + x

A mixture of experts' MLP block routes this rank's positions first and all-gathers the choices
with the hidden state (`MegatronLM.experts`).

Forward: 2 all-gathers and 2 reduce-scatters of an (S, B, H) activation per layer. Backward: each
all-gather's adjoint is a reduce-scatter of the input gradient and each reduce-scatter's is an
all-gather of the output gradient: 2 + 2 more (the first block's reduce-scatter is skipped when
nothing before it trains, e.g. LoRA's frozen embeddings). `parallel.sequence_parallel=false` gives
plain Megatron TP for comparison: the same blocks bracketed by f (identity forward, all-reduce
backward) and g (all-reduce forward, identity backward), the residual stream replicated. An
all-reduce moves as many bytes on a ring as a reduce-scatter plus an all-gather, so SP is free in
traffic and divides the memory of everything outside the blocks by N.

Masking and positions. A padded batch (`attention_mask`) gets a causal mask only
(`is_causal=True`, no padding mask). That is exact for every labelled position because batches
are right-padded (checked per micro-batch) and labels are pre-shifted with -100 on padding: a real
position attends only to earlier positions, all real, so its output, and thus the loss and every
gradient, equals the padding-masked one; padded positions get garbage but carry no loss and nothing
real attends to them. The same holds for the positions appended so that N divides S (token 0,
label -100). Rotary embeddings get the global position ids 0..S-1 explicitly, computed once per
forward (attention runs on the gathered full sequence, so no rank ever sees shard-local positions).
A packed batch (`position_ids`, restarting at 0 at every document; docs/packing.md) gets those
position ids for rotary and a block-diagonal causal mask built from them (`document_mask`), so no
document attends to another; the appended positions are documents of their own.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # every family's

from distft.data import document_ids
from distft.model.checkpointing import HostOffload
from distft.model.lm import check_right_padded
from distft.model.preference import sequence_logps
from distft.parallel.megatron.collectives import (
    copy_to_tp_region,
    gather_from_sp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
    sequence_sums,
)
from distft.parallel.megatron.layers import adapters_disabled
from distft.parallel.sequence_head import SequenceSplitHead


class MegatronLM(SequenceSplitHead, nn.Module):
    """The `LossLM` (kept as `.module`, where `unwrap` finds it) run as Megatron TP (+ SP).

    The HF submodules (embedding, norms, rotary, q_norm/k_norm, MLP activation) are called as they
    are; only the decoder layer's wiring is written out here, with the collectives in view. It is
    the wiring every family shares (Qwen3, Llama, Qwen2, Mistral); what differs, q/k norms and
    q/k/v biases, lives in the modules it calls.
    """

    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup | None,
        sequence_parallel: bool,
        checkpointing: str = "none",
    ):
        super().__init__()
        self.module = module
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.sequence_parallel = sequence_parallel
        self.checkpointing = checkpointing  # none, full or offload (`distft.model.checkpointing`)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Into a block: the full (S, B, H) every rank needs for its column projections."""
        if self.sequence_parallel:
            return gather_from_sp_region(x, self.group)
        return copy_to_tp_region(x, self.group)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """Out of a block: sum the row projection's partial (S, B, H); with SP keep this rank's S/N."""
        if self.sequence_parallel:
            return reduce_scatter_to_sp_region(x, self.group)
        return reduce_from_tp_region(x, self.group)

    @property
    def share(self) -> float:
        return 1 / self.world if self.sequence_parallel else 1.0  # without SP every rank has it whole

    def own_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """The labels of the positions this rank's loss runs on: its S/N with SP (as `hidden_states`)."""
        if not self.sequence_parallel:
            return labels
        seq = labels.shape[1] + -labels.shape[1] % self.world
        return labels[:, self.rank * seq // self.world : (self.rank + 1) * seq // self.world]

    def adapters_off(self) -> contextlib.AbstractContextManager:
        return adapters_disabled(self.module.lm)  # the shards carry no peft state to switch

    def router_term(
        self, router, units: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The routers' auxiliary losses (a mixture of experts). Each rank routed its own positions of
        every row, sequence-first: with SP its shard, pooled over the ranks as context parallelism
        pools them (the fill that evens the shards left out); without, all of them, as one process
        does."""
        real = (torch.ones_like(input_ids) if attention_mask is None else attention_mask).t().float()
        if not self.sequence_parallel:  # (S, B): the order the router saw the positions in
            return router.term(units, None if attention_mask is None else real)
        real = F.pad(real, (0, 0, 0, -real.shape[0] % self.world), value=0)
        positions = real.shape[0] // self.world
        return router.split_term(units, real[self.rank * positions : (self.rank + 1) * positions], self.group)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, int] | None]:
        """The final norm's output on this rank's positions (S/N, B, H) (all S without SP), their
        labels (S/N, B), and a packed row's documents: each position's (1, S/N) and how many."""
        check_right_padded(attention_mask, "tp-sp")
        backbone = self.module.backbone
        input_ids, labels = input_ids.t(), labels.t()  # sequence-first: (S, B)
        packed = position_ids is not None
        # A packed row's sequences are its documents, not the positions appended below.
        sequences = int(document_ids(position_ids).max()) + 1 if packed else 0
        if position_ids is None:  # padded: global positions 0..S-1
            position_ids = torch.arange(input_ids.shape[0], device=input_ids.device).unsqueeze(0)
        if self.sequence_parallel:  # N must divide S: append positions that carry no loss
            pad = -input_ids.shape[0] % self.world
            input_ids = F.pad(input_ids, (0, 0, 0, pad), value=0)
            labels = F.pad(labels, (0, 0, 0, pad), value=-100)
            position_ids = F.pad(position_ids, (0, pad), value=0)  # packed: each one a document
        seq = input_ids.shape[0]
        mask = document_mask(position_ids) if attention_mask is None else None  # (B or 1, 1, S, S)
        cos, sin = backbone.rotary_emb(backbone.embed_tokens.weight, position_ids)  # (B or 1, S, head_dim)
        documents = document_ids(position_ids) if packed else None  # (1, S)
        if self.sequence_parallel:
            mine = slice(self.rank * seq // self.world, (self.rank + 1) * seq // self.world)
            input_ids, labels = input_ids[mine], labels[mine]
            documents = documents[:, mine] if packed else None
        x = backbone.embed_tokens(input_ids)  # (S/N, B, H): each rank embeds only its own tokens
        offload = self.checkpointing == "offload" and torch.is_grad_enabled()
        with HostOffload() if offload else contextlib.nullcontext():  # each layer's input to the host
            for layer in backbone.layers:
                if self.checkpointing != "none":
                    # early_stop=False: recompute the whole layer, so its 4 collectives rerun every time
                    x = checkpoint(
                        self.layer, layer, x, cos, sin, mask, use_reentrant=False, early_stop=False
                    )
                else:
                    x = self.layer(layer, x, cos, sin, mask)
        return backbone.norm(x), labels, (documents, sequences) if packed else None

    def sequence_logps(
        self, x: torch.Tensor, labels: torch.Tensor, documents, grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's log-probability and labelled tokens (`distft.model.preference`), summed
        over this rank's positions, then (SP) over the ranks: one all-reduce of both, whose
        backward sums the ranks' gradients (`all_reduce_shares`), since each rank then backpropagates
        its share of the loss."""
        logps, counts = sequence_logps(
            x.transpose(0, 1), self.module.lm_head, labels.t(), documents=documents
        )
        return sequence_sums(logps, counts, self.group, grad) if self.sequence_parallel else (logps, counts)

    def layer(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """One decoder layer (every family's: q/k norms and q/k/v biases where it has them). x: (S/N, B, H) with SP, (S, B, H) without; mask: packed rows'
        block-diagonal causal mask, None for plain causal attention."""
        attn, mlp = layer.self_attn, layer.mlp
        h = self.enter(layer.input_layernorm(x))  # (S, B, H)
        seq, batch, _ = h.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # (S, B, n * d) -> (B, n, S, d)
            return t.view(seq, batch, -1, attn.head_dim).permute(1, 2, 0, 3)

        q = heads(head_norm(attn, "q_norm", attn.q_proj(h).view(seq, batch, -1, attn.head_dim)).flatten(2))
        k = heads(head_norm(attn, "k_norm", attn.k_proj(h).view(seq, batch, -1, attn.head_dim)).flatten(2))
        v = heads(attn.v_proj(h))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=attn.attention_dropout if self.training else 0.0,
            is_causal=mask is None,
            scale=attn.scaling,
            enable_gqa=True,  # H/N query heads share KV/N KV heads, the same grouping as unsplit
        )
        o = o.permute(2, 0, 1, 3).reshape(seq, batch, -1)  # (S, B, H/N * d): this rank's heads
        x = x + self.leave(attn.o_proj(o))

        normed = layer.post_attention_layernorm(x)
        if hasattr(mlp, "experts"):  # a mixture of experts
            return x + self.leave(self.experts(mlp, normed))
        h = self.enter(normed)
        return x + self.leave(mlp.down_proj(mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h)))

    def experts(self, mlp: nn.Module, normed: torch.Tensor) -> torch.Tensor:
        """A mixture of experts' block on this rank's positions `normed` (S/N, B, H) with SP, (S, B,
        H) without: the router picks each position's experts here, on this rank's positions only;
        the hidden states, the choices and their weights then enter the block like any input, and
        this rank's features of every expert (`tp_experts.cut_experts`) give a partial sum of every
        token's output, which `leave` reduces. Without SP the router's input skips f, whose
        backward would sum its gradient, complete on every rank, N times."""
        _, weights, chosen = mlp.gate(normed)  # (positions x B, k): sequence-first
        rows = (*normed.shape[:2], -1)
        h, weights, chosen = self.enter(normed), self.enter(weights.view(rows)), self.enter(chosen.view(rows))
        return mlp.experts(h.flatten(0, 1), chosen.flatten(0, 1), weights.flatten(0, 1)).view(h.shape)


def head_norm(attn: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """Qwen3's RMSNorm over each head of q or k; the identity for the families without one."""
    norm = getattr(attn, name, None)
    return x if norm is None else norm(x)


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, S, S) boolean mask of a packed row: position i sees j iff j <= i, same document."""
    doc = document_ids(position_ids)
    seq = doc.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc.device).tril()
    return (causal & (doc[:, :, None] == doc[:, None, :])).unsqueeze(1)
