"""The loss head of a model whose ranks each hold some of every sequence's positions: context
parallelism (`cp`, `fsdp+cp`) and tensor parallelism with sequence parallelism (`tp-sp`).

Each rank computes the loss over its own positions, which `reduce_loss` sums over the ranks; a
preference objective needs whole sequences instead, so each sequence's log-probability is summed
over the ranks first (`sequence_logps`: one all-reduce whose backward sums the ranks' gradient
shares) and every rank computes the objective's head whole, as its `share` of the loss. A model
mixes this in and gives `hidden_states` (the final norm's output on its positions, their labels,
a packed row's documents), `own_labels` (the labels of its positions, which the planner's figure
for a running micro-batch counts), `sequence_logps`, `router_term` (an MoE's auxiliary losses over
its positions), `share` and `adapters_off` (the base under disabled adapters, the reference).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from distft.model import summed_loss
from distft.model.router import catching


class SequenceSplitHead:
    def forward(
        self,
        input_ids: torch.Tensor,  # (batch, seq)
        labels: torch.Tensor,  # (batch, seq), pre-shifted, -100 where no loss
        attention_mask: torch.Tensor | None = None,  # (batch, seq), 1 for real tokens, right-padded
        position_ids: torch.Tensor | None = None,  # (batch, seq), from 0 at each document (packed)
        **preference: torch.Tensor,  # a preference objective's (`LossLM.forward`)
    ) -> torch.Tensor:
        module = self.module  # the `LossLM`
        with catching(module.router):  # an MoE's, for `with_router_term`
            hidden, mine, documents = self.hidden_states(input_ids, labels, attention_mask, position_ids)
        if module.preference is None:
            loss = summed_loss(hidden, module.lm_head, mine)  # this rank's positions' share of the loss
            return self.with_router_term(loss, labels.ne(-100).sum(), input_ids, attention_mask)
        logps, counts = self.sequence_logps(hidden, mine, documents, grad=True)

        @torch.no_grad()
        def base() -> torch.Tensor:  # the reference under disabled adapters, as `LossLM` runs it
            with self.adapters_off():
                return self.sequence_logps(
                    *self.hidden_states(input_ids, labels, attention_mask, position_ids)
                )[0]

        router_term = functools.partial(
            self.with_router_term, input_ids=input_ids, attention_mask=attention_mask
        )
        return module.preference_head(logps, counts, base, preference, self.share, router_term)

    def with_router_term(
        self,
        loss: torch.Tensor,
        units: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The loss carrying the routers' auxiliary losses over this rank's positions (`router_term`),
        when the model is a mixture of experts that routed in this forward."""
        router = self.module.router
        if router is None or not router.caught:
            return loss
        term = self.router_term(router, torch.as_tensor(units, device=loss.device), input_ids, attention_mask)
        return loss if term is None else loss + term

    @property
    def share(self) -> float:
        """This rank's part of a preference head computed whole on every rank (`reduce_loss` sums them)."""
        return 1 / self.world

    def adapters_off(self) -> contextlib.AbstractContextManager:
        return self.module.lm.disable_adapter()
