"""The loss head every strategy wraps: a causal LM whose forward returns the summed token loss.

`LossLM` wraps the causal LM so that its forward returns the summed cross-entropy over the
labelled (summary) positions. Only those positions go through lm_head: with Qwen3's 151,936-token
vocabulary the logits of the whole prompt would dominate memory for nothing, since the prompt
carries no loss. Every strategy wraps a `LossLM`, so DDP/FSDP hooks see one forward.

The decoder layers run here (`run_layers`), not through the family's `Model.forward`: Llama,
Qwen2, Mistral and Qwen3 build their masks differently there, and the pipeline stages must run a
slice of the layers anyway. What every family's forward computes once (positions, the mask of
each layer type, the rotary cos/sin) is computed here the same way for all of them, then each
layer is called as transformers calls it.

A batch is padded (`attention_mask`, one sequence per row) or packed (`position_ids` restarting
at 0 at every document, no mask; `distft.data.batches.pack`; a row of one document carries no
position ids). Under the `flex` kernel a packed row's document block mask is built here, once per
micro-batch (`distft.model.attention.packed_attention_masks`); under the others it goes to
transformers with `attention_mask=None`, which reads the position restarts as document boundaries
(a dense block-diagonal mask for sdpa/eager, flash-attention's varlen kernel).

`label_positions` (flat indices of the labelled positions, computed on the host with the batch)
lets the head gather those positions without a boolean index, whose size the host would have to
wait for (a device-to-host sync per micro-batch on CUDA). When the labelled positions' fp32 logits
would exceed `distft.model.loss.LOGITS_BUDGET_BYTES` (long rows with loss on every token), the head
runs chunk by chunk (`distft.model.loss.chunked_cross_entropy`), never holding the whole logits.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from peft import PeftModel
from torch import nn
from transformers import PreTrainedModel
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from distft.model.attention import FLEX, packed_attention_masks
from distft.model.checkpointing import HostOffload, offloads
from distft.model.families import layer_types
from distft.model.loss import chunked_cross_entropy, loss_chunk
from distft.model.preference import PreferenceLoss, sequence_logps
from distft.model.router import RouterLosses, catching


def causal_lm(model: nn.Module) -> PreTrainedModel:
    """The transformers model inside any peft wrapper."""
    if isinstance(model, PeftModel):
        return model.base_model.model
    return model


class LossLM(nn.Module):
    """A causal LM whose forward returns the sum of its token losses (or, for a preference
    objective, of its pairs' losses: `distft.model.preference`).

    `labels` are already shifted: labels[b, t] is the token that position t must predict, or -100.
    """

    def __init__(
        self, lm: nn.Module, preference: PreferenceLoss | None = None, router: RouterLosses | None = None
    ):
        super().__init__()
        self.lm = lm  # the peft model (LoRA) or the plain causal LM (full); saved as-is
        inner = causal_lm(lm)
        self.backbone = inner.model  # e.g. LlamaModel: embeddings, decoder layers, final norm
        self.lm_head = inner.lm_head
        self.preference = preference  # train.objective dpo | orpo | kto (`distft.model.preference`)
        # forward returns each sequence's log-probability instead of the loss (True: the reference
        # scored before the first step, `distft.train.reference`), or ("ratio") its log-ratio to
        # the reference's (KTO's KL term, scored before each step).
        self.scoring: bool | str = False
        self.router = router  # a mixture of experts' auxiliary losses (`distft.model.router`)

    def forward(
        self,
        input_ids: torch.Tensor,  # (batch, seq)
        labels: torch.Tensor,  # (batch, seq), shifted, -100 where no loss
        attention_mask: torch.Tensor | None = None,  # (batch, seq), 1 for real tokens (padded)
        position_ids: torch.Tensor | None = None,  # (batch, seq), from 0 at each document (packed)
        label_positions: torch.Tensor | None = None,  # (n_labelled,) flat indices where labels != -100
        token_weight: torch.Tensor | None = None,  # ORPO: pairs / chosen tokens of the global batch, (1,)
        reference: torch.Tensor | None = None,  # DPO, KTO: each row's reference log-probability, precomputed
        desirable: torch.Tensor | None = None,  # KTO: (rows,) bool, each answer's label
        kl: torch.Tensor | None = None,  # KTO: the global batch's KL estimate, (1,)
    ) -> torch.Tensor:
        hidden = self.routed_hidden_states(input_ids, attention_mask, position_ids)
        if self.preference is None:
            loss = summed_loss(hidden, self.lm_head, labels, label_positions)
            units = label_positions.numel() if label_positions is not None else labels.ne(-100).sum()
            return self.with_router_term(loss, units, attention_mask)
        logps, counts = sequence_logps(hidden, self.lm_head, labels, position_ids)

        @torch.no_grad()
        def base() -> torch.Tensor:  # each sequence's log-probability with the adapters disabled
            with self.lm.disable_adapter():
                again = self.hidden_states(input_ids, attention_mask, position_ids)
                return sequence_logps(again, self.lm_head, labels, position_ids)[0]

        extra = {"reference": reference, "token_weight": token_weight, "desirable": desirable, "kl": kl}
        router_term = functools.partial(self.with_router_term, attention_mask=attention_mask)
        return self.preference_head(logps, counts, base, extra, router_term=router_term)

    def routed_hidden_states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """`hidden_states`, the routers' outputs caught on the way (a mixture of experts)."""
        with catching(self.router):
            return self.hidden_states(input_ids, attention_mask, position_ids)

    def with_router_term(
        self, loss: torch.Tensor, units: torch.Tensor | int, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """The loss, its value unchanged, carrying the routers' auxiliary losses' gradient."""
        if self.router is None:
            return loss
        term = self.router.term(torch.as_tensor(units, device=loss.device), attention_mask)
        return loss if term is None else loss + term

    def preference_head(
        self,
        logps: torch.Tensor,  # (sequences,): each sequence's whole log-probability
        counts: torch.Tensor,  # (sequences,): its labelled tokens
        base: Callable[[], torch.Tensor] | None,  # the reference's, run when not given (precomputed)
        inputs: dict[str, torch.Tensor | None],  # reference, token_weight, desirable, kl
        share: float = 1.0,  # this rank's share where every rank computes the same head (tp-sp, cp)
        router_term: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The preference objective's loss, or in scoring mode each sequence's log-probability (or
        its log-ratio to the reference: KTO's KL term), times `share`: the one head of every
        strategy, given the sequences' log-probabilities however it summed them. `router_term`
        (loss, units) adds a mixture of experts' auxiliary losses to the loss, as the strategy
        pools them (`with_router_term`)."""
        reference = inputs.get("reference")
        if self.scoring:
            keep = counts > 0  # every sequence has a label; a packed row's fill has none
            if self.scoring == "ratio":
                return (logps[keep] - (base()[keep] if reference is None else reference)) * share
            return logps[keep] * share
        if self.preference.needs_reference and reference is None:
            reference = base()
        get = inputs.get
        loss = self.preference(
            logps, counts, reference, get("token_weight"), get("desirable"), get("kl"), share
        )
        if router_term is None:
            return loss
        return router_term(loss, self.preference.units(counts, get("desirable")))

    def hidden_states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """The final norm's output, (batch, seq, hidden)."""
        backbone = self.backbone
        hidden = backbone.embed_tokens(input_ids)
        hidden = run_layers(backbone, enumerate(backbone.layers), hidden, attention_mask, position_ids)
        return backbone.norm(hidden)


def run_layers(
    backbone: nn.Module,
    layers: Iterable[tuple[int, nn.Module]],
    hidden: torch.Tensor,  # (batch, seq, hidden): the embedded tokens or an earlier stage's output
    attention_mask: torch.Tensor | None = None,  # (batch, seq), 1 for real tokens (padded)
    position_ids: torch.Tensor | None = None,  # (batch, seq), from 0 at each document (packed)
    masks: dict | None = None,  # ready-made mask per layer type, used as given (context parallelism)
) -> torch.Tensor:
    """`layers` (index, decoder layer) of `backbone` on `hidden`, with what the family's own forward
    computes once: positions (0..S-1 with right padding), each layer type's mask (unless `masks`
    gives them), rotary cos/sin."""
    config = backbone.config
    documents = position_ids  # None: a row of one document, plain causal attention
    if position_ids is None:
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    if masks is None and attention_mask is None and config._attn_implementation == FLEX:
        masks = packed_attention_masks(config, documents)  # packed, flex: built here
    elif masks is None:  # else the caller's (`distft.parallel.context`: what its attention reads)
        masks = transformers_masks(config, hidden, attention_mask, position_ids)
    position_embeddings = backbone.rotary_emb(hidden, position_ids)
    kinds = layer_types(config)
    layers = list(layers)
    offload = offloads([layer for _, layer in layers]) and torch.is_grad_enabled()
    with HostOffload() if offload else contextlib.nullcontext():  # `model.activation_checkpointing`
        for index, layer in layers:
            hidden = layer(
                hidden,
                attention_mask=masks[kinds[index]],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
            )
    return hidden


def check_right_padded(attention_mask: torch.Tensor | None, strategy: str) -> None:
    """ValueError unless every row's padding is at its end: a strategy whose attention is causal
    only (tp-sp, cp) then needs no mask, since no real token attends to a later position."""
    if attention_mask is not None and (attention_mask[:, 1:] > attention_mask[:, :-1]).any():
        raise ValueError(
            f"{strategy} applies a causal mask only, which is exact for right-padded batches only"
        )


def transformers_masks(config, hidden: torch.Tensor, attention_mask, position_ids) -> dict:
    """What the family's forward builds: causal + padding, or (packed, no mask) block-diagonal
    from the position ids' restarts; one per layer type."""
    mask_args = {
        "config": config,
        "inputs_embeds": hidden,
        "attention_mask": attention_mask,  # None: packed, read from the position ids
        "cache": None,
        "position_ids": position_ids,
    }
    kinds = set(layer_types(config))
    masks = {"full_attention": create_causal_mask(**mask_args)} if "full_attention" in kinds else {}
    if "sliding_attention" in kinds:
        masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_args)
    return masks


def summed_loss(
    hidden: torch.Tensor,  # (batch, seq, hidden)
    lm_head: nn.Module,
    labels: torch.Tensor,  # (batch, seq), shifted, -100 where no loss
    label_positions: torch.Tensor | None = None,  # (n_labelled,) flat indices where labels != -100
    *,
    chunk: int | None = None,  # rows per chunk of the head; None: `loss_chunk` decides
) -> torch.Tensor:
    """Sum of cross-entropy over labelled positions; lm_head runs on those positions only, in chunks
    when their logits would be large (or `chunk` is given) and the head can be chunked."""
    if label_positions is None:
        keep = labels != -100
        hidden, labels = hidden[keep], labels[keep]  # a boolean index: the host waits for its size
    else:
        hidden = hidden.flatten(0, 1).index_select(0, label_positions)
        labels = labels.flatten().index_select(0, label_positions)
    lm_head = trained_copy(lm_head)
    if chunkable(lm_head):
        chunk = chunk or loss_chunk(hidden.shape[0], lm_head.out_features)
        if chunk:
            return chunked_cross_entropy(hidden, lm_head.weight, labels, chunk)
    logits = lm_head(hidden).float()  # (n_labelled, vocab); fp32 for a stable softmax
    return F.cross_entropy(logits, labels, reduction="sum")


def trained_copy(module: nn.Module) -> nn.Module:
    """The module that runs in `module`'s place: under `lora.modules_to_save`, peft's wrapper runs
    its trained copy (`distft.model.tokens`), which the chunked loss can take as a plain Linear."""
    copies = getattr(module, "modules_to_save", None)
    if isinstance(copies, nn.ModuleDict) and not module.disable_adapters and module.active_adapters:
        return copies[module.active_adapters[0]]
    return module


def chunkable(lm_head: nn.Module) -> bool:
    """Whether `chunked_cross_entropy(hidden, lm_head.weight, ...)` computes what lm_head would: a
    plain Linear without bias, its weight a plain tensor. Not a peft-wrapped head (its forward adds
    the adapter), not a sharded weight (a DTensor: TP, or FSDP2 at rest), nor any other subclass."""
    return (
        type(lm_head) is nn.Linear  # FSDP2 changes the class of a module it shards (FSDPLinear)
        and lm_head.bias is None
        and type(lm_head.weight) in (torch.Tensor, nn.Parameter)  # a subclass (DTensor) keeps its type
    )


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total
