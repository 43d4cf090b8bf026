"""The `LossLM` forward on this rank's share of every row's positions (context parallelism).

Per forward: pad each row to a multiple of 2N (fill token 0, label -100, positions continuing),
take this rank's chunks r and 2N-1-r of every row with their global position ids, embed those
tokens, run the decoder layers (`distft.model.lm.run_layers`, so the layers' activation
checkpointing and host offload apply as in one process) with the CP attention installed as the
model's kernel and a `ContextShard` as every layer's mask, then the final norm and the loss over
this rank's labelled positions only. The loss is this rank's share of the row's summed loss. A
preference objective's head needs each answer's whole log-probability: the ranks' sums over their
positions are all-reduced, every rank computes the head, and each backpropagates 1/N of it (the
all-reduce's backward sums the shares' gradients, `all_reduce_shares`).

The attention kernel is picked by name, `config._attn_implementation`, which every attention
module reads when it runs. It is `CONTEXT` while this forward runs and restored after, so the
model is unchanged outside it. A layer checkpointed in full reruns its forward in backward,
outside this forward: a hook on the layers' output gradient installs `CONTEXT` again when
backward reaches the layers, and the end of that backward restores it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distft.model.families import layer_types
from distft.model.lm import check_right_padded, run_layers
from distft.model.preference import sequence_logps
from distft.parallel.context.attention import CONTEXT, ContextShard, register
from distft.parallel.megatron.collectives import sequence_sums
from distft.parallel.sequence_head import SequenceSplitHead
from distft.tensors import document_ids


def padded_length(seq: int, world: int) -> int:
    """A row's length once padded to 2N equal chunks (a head and a tail per rank)."""
    return -(-seq // (2 * world)) * 2 * world


def layers_without_kv_gradient(frozen: bool, targets: set[str]) -> int:
    """Layers whose gathered K and V need no gradient, so backward reduce-scatters none: LoRA's
    first layer when nothing before its k/v projections trains (`frozen` embedding, no adapter on
    k_proj or v_proj)."""
    return int(frozen and not targets & {"k_proj", "v_proj"})


class ContextParallelLM(SequenceSplitHead, nn.Module):
    """The `LossLM` (kept as `.module`, where `unwrap` finds it) run on 1/N of every row."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None, method: str = "allgather"):
        super().__init__()
        self.module = module
        self.group, self.method = group, method
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        register()

    def local_positions(self, seq: int, device: torch.device) -> tuple[int, torch.Tensor]:
        """(L, the 2L indices of this rank's positions in a row of `seq`, a multiple of 2N)."""
        length = seq // (2 * self.world)
        head, tail = self.rank, 2 * self.world - 1 - self.rank
        index = torch.cat([torch.arange(c * length, (c + 1) * length, device=device) for c in (head, tail)])
        return length, index

    def own_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """The labels of the positions this rank's loss runs on: its two chunks (the fill has none)."""
        seq = labels.shape[1]
        index = self.local_positions(padded_length(seq, self.world), labels.device)[1]
        return labels[:, index[index < seq]]

    def router_term(
        self, router, units: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor | None:
        """This rank's share of the routers' auxiliary losses (a mixture of experts), pooled over
        every rank's tokens but the padding and the fill."""
        seq = input_ids.shape[1]
        real = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        real = F.pad(real, (0, padded_length(seq, self.world) - seq), value=0)
        index = self.local_positions(real.shape[1], real.device)[1]
        return router.split_term(units, real[:, index], self.group)

    def sequence_logps(
        self, hidden, labels, documents, grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's log-probability and labelled tokens over this rank's positions, summed
        over the ranks by one all-reduce, whose backward sums the ranks' gradient shares
        (`all_reduce_shares`, as tp-sp's head)."""
        logps, counts = sequence_logps(hidden, self.module.lm_head, labels, documents=documents)
        return sequence_sums(logps, counts, self.group, grad)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, int] | None]:
        """The final norm's output on this rank's positions (B, 2L, H), their labels, and a packed
        row's documents: each of those positions' and how many in the row."""
        check_right_padded(attention_mask, "cp")
        # Padded rows: the mask is dropped. With causal attention no real position sees a later
        # one, so none sees padding; padding carries no label (`distft.parallel.context`).
        seq = input_ids.shape[1]
        packed = position_ids is not None  # one document per row otherwise: plain causal
        if position_ids is None:
            position_ids = torch.arange(seq, device=input_ids.device).unsqueeze(0)  # (1, S)
        pad = padded_length(seq, self.world) - seq  # fill: no label, positions continuing the row's last
        if pad:
            input_ids = F.pad(input_ids, (0, pad), value=0)
            labels = F.pad(labels, (0, pad), value=-100)
            more = torch.arange(1, pad + 1, device=position_ids.device)
            position_ids = torch.cat([position_ids, position_ids[:, -1:] + more], dim=1)
        length, index = self.local_positions(seq + pad, input_ids.device)
        shard = ContextShard(
            group=self.group,
            rank=self.rank,
            world=self.world,
            chunk=length,
            chunks=(self.rank, 2 * self.world - 1 - self.rank),
            documents=document_ids(position_ids) if packed else None,  # (B, S), the fill in the last
            method=self.method,
        )
        backbone = self.module.backbone
        config = backbone.config
        previous = config._attn_implementation
        config._attn_implementation = CONTEXT
        try:
            hidden = backbone.embed_tokens(input_ids[:, index])  # (B, 2L, H): this rank's tokens
            hidden = run_layers(
                backbone,
                enumerate(backbone.layers),
                hidden,
                position_ids=position_ids[:, index],  # global: rotary at each token's own position
                masks=dict.fromkeys(set(layer_types(config)), shard),
            )
        finally:
            config._attn_implementation = previous
        if hidden.requires_grad:
            hidden.register_hook(_attention_in_backward(config, previous))
        ids = document_ids(position_ids) if packed else None  # the fill continues the last document
        documents = (ids[:, index], int(ids.max()) + 1) if packed else None
        return backbone.norm(hidden), labels[:, index], documents


def _attention_in_backward(config, previous: str | None):
    """A gradient hook on the layers' output: backward reaches it before any layer's backward, so
    a layer recomputed there (activation checkpointing) runs `CONTEXT` again; restored when this
    backward ends."""

    def restore() -> None:
        config._attn_implementation = previous

    def install(grad: torch.Tensor) -> torch.Tensor:
        config._attn_implementation = CONTEXT
        torch.autograd.Variable._execution_engine.queue_callback(restore)  # when this backward ends
        return grad

    return install
