"""The `[moe]` section of the run configuration (`distft.config.schema`): the router's auxiliary
losses on a mixture-of-experts model (`distft.model.router`); a dense model ignores it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MoeConfig:
    aux_loss_coef: float = 0.001
    """The weight of the router's load-balancing loss (Switch Transformer's; Qwen3-MoE's
    router_aux_loss_coef, 0.001), added to every micro-batch's objective; 0: not added (its value
    is still recorded)."""
    z_loss_coef: float = 0.0
    """The weight of the router's z-loss (ST-MoE's: the squared log-sum-exp of its logits; 0.001 there);
    0: not added (its value is still recorded)."""
