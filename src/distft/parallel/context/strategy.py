"""`cp`: context parallelism, each rank on 1/N of every row's positions (`distft.parallel.context`).

Every rank reads the same rows (no data parallelism) and holds the whole model, replicated as under
DDP: nothing is sharded, so QLoRA's NF4 base, checkpoints and the export are the single model's.

Gradients. Each rank back-propagates its own positions' share of the summed loss, so each weight's
gradient on a rank is the gradient of that share (K and V's, already summed over every rank's
queries by the reduce-scatter in backward). The whole gradient is their sum: `after_backward`
all-reduces every trainable gradient once per optimizer step, in one flat buffer, after the last
micro-batch (as Megatron's partial gradients). After it the gradients are equal on every rank,
so the norm counts each once (the base class's `gradient_shares`: plain tensors, replicated).

Loss. Each rank's loss sum covers its own positions: `reduce_loss` all-reduces it. The loop divides
by the global count of labelled positions, which every rank counts itself from the whole batch.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from distft.config import Config
from distft.errors import ConfigError
from distft.parallel.base import Strategy, summed, unwrap
from distft.parallel.context.model import ContextParallelLM
from distft.parallel.grads import all_reduce_flat


class ContextSplit:
    """What `cp` and `fsdp+cp` share (list it before the strategy class it extends): the attention
    the CP wrapper computes checked (`check_attention`), the loss summed over every rank, and
    checkpoints in the single model's names: the state of the `LossLM` under the CP wrapper, whose
    `module.` prefix would otherwise hide every name from the base class's filter."""

    @classmethod
    def validate_model(cls, cfg: Config, model_config: PretrainedConfig) -> None:
        super().validate_model(cfg, model_config)  # type: ignore[misc]  # NF4 blocks under qlora
        check_attention(cls.name, model_config)  # type: ignore[attr-defined]

    def reduce_loss(self, local_sum: torch.Tensor) -> torch.Tensor:
        return summed(local_sum)  # each rank's share: its rows' loss over its positions

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        return super().checkpoint_state(unwrap(model), optimizer)  # type: ignore[misc]

    def load_checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        super().load_checkpoint_state(unwrap(model), optimizer, state)  # type: ignore[misc]


class ContextParallel(ContextSplit, Strategy):
    name = "cp"

    def parallelize(self, model: nn.Module) -> nn.Module:
        return ContextParallelLM(model.to(self.env.device), group=None, method=self.cfg.parallel.cp_method)

    def after_backward(self, model: nn.Module) -> None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        all_reduce_flat(grads)  # one collective: each rank held its positions' share


def check_attention(strategy: str, model_config: PretrainedConfig) -> None:
    """What the context-parallel attention computes: full causal attention, no dropout."""
    if set(getattr(model_config, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        raise ConfigError(f"--strategy {strategy} supports full attention only (no sliding window).")
    if getattr(model_config, "attention_dropout", 0.0):
        raise ConfigError(f"--strategy {strategy} runs without attention dropout (attention_dropout=0).")
