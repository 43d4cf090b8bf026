"""The loss head every strategy wraps: a causal LM whose forward returns the summed token loss.

`SummaryLM` wraps the causal LM so that its forward returns the summed cross-entropy over the
labelled (summary) positions. Only those positions go through lm_head: with Qwen3's 151,936-token
vocabulary the logits of the whole prompt would dominate memory for nothing, since the prompt
carries no loss. Every strategy wraps a `SummaryLM`, so DDP/FSDP hooks see one forward.

A batch is padded (`attention_mask`, one sequence per row) or packed (`position_ids` restarting
at 0 at every document, no mask; `distft.data.batches.pack`; a row of one document carries no
position ids). Under the `flex` kernel a packed row's document block mask is built here, once per
micro-batch (`distft.model.attention.packed_attention_masks`); under the others it goes to
transformers with `attention_mask=None`, which reads the position restarts as document boundaries
(a dense block-diagonal mask for sdpa/eager, flash-attention's varlen kernel).

`label_positions` (flat indices of the labelled positions, computed on the host with the batch)
lets the head gather those positions without a boolean index, whose size the host would have to
wait for (a device-to-host sync per micro-batch on CUDA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft import PeftModel
from torch import nn
from transformers import Qwen3ForCausalLM

from distft.model.attention import FLEX, packed_attention_masks


def causal_lm(model: nn.Module) -> Qwen3ForCausalLM:
    """The transformers model inside any peft wrapper."""
    if isinstance(model, PeftModel):
        return model.base_model.model
    return model


class SummaryLM(nn.Module):
    """A causal LM whose forward returns (sum of token losses, number of labelled tokens).

    `labels` are already shifted: labels[b, t] is the token that position t must predict, or -100.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm  # the peft model (LoRA) or the plain causal LM (full); saved as-is
        inner = causal_lm(lm)
        self.backbone = inner.model  # Qwen3Model: embeddings, decoder layers, final norm
        self.lm_head = inner.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,  # (batch, seq)
        labels: torch.Tensor,  # (batch, seq), shifted, -100 where no loss
        attention_mask: torch.Tensor | None = None,  # (batch, seq), 1 for real tokens (padded)
        position_ids: torch.Tensor | None = None,  # (batch, seq), from 0 at each document (packed)
        label_positions: torch.Tensor | None = None,  # (n_labelled,) flat indices where labels != -100
    ) -> torch.Tensor:
        config = self.backbone.config
        if attention_mask is None and config._attn_implementation == FLEX:
            attention_mask = packed_attention_masks(config, position_ids)  # a dict: used as it is
        # use_cache=False: a KV cache would also switch off transformers' packed-row detection.
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return summed_loss(hidden, self.lm_head, labels, label_positions)


def summed_loss(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor,
    label_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum of cross-entropy over labelled positions; lm_head runs on those positions only."""
    if label_positions is None:
        keep = labels != -100
        hidden, labels = hidden[keep], labels[keep]  # a boolean index: the host waits for its size
    else:
        hidden = hidden.flatten(0, 1).index_select(0, label_positions)
        labels = labels.flatten().index_select(0, label_positions)
    logits = lm_head(hidden).float()  # (n_labelled, vocab); fp32 for a stable softmax
    return F.cross_entropy(logits, labels, reduction="sum")


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total
