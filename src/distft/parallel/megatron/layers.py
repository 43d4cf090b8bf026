"""The sharded projections of Megatron TP: one rank's slice of each decoder layer's linear layers.

Rank r of N keeps 1/N of each projection of each decoder layer; a `Linear` weight is (out, in) in
torch's convention. Which projection is which style comes from `tensor_parallel.COLUMN` / `ROW`:

| projection             | base weight split on | lora_A (r, in)  | lora_B (out, r) | rank r computes     |
|------------------------|----------------------|-----------------|-----------------|---------------------|
| q_proj, k_proj, v_proj | out (dim 0)          | replicated      | out (dim 0)     | its H/N query heads and KV/N KV heads |
| gate_proj, up_proj     | out (dim 0)          | replicated      | out (dim 0)     | its slice of the MLP features |
| o_proj                 | in (dim 1)           | in (dim 1)      | replicated      | a partial sum over its heads |
| down_proj              | in (dim 1)           | in (dim 1)      | replicated      | a partial sum over its features |

No collective runs in here, forward or backward: the decoder layer (`model.py`) places them at
block boundaries, where q/k/v (and gate/up) share one gathered input, one all-gather for three
projections, and the row projection's partial sum is reduced once.

LoRA under TP. The adapter is sharded like its base so both paths produce the same layout: a
column layer's lora_A turns the full input into (S, B, r) on every rank and its sharded lora_B
gives this rank's output features. A row layer's sharded lora_A gives a partial (S, B, r) sum and
the replicated lora_B maps it to a partial (S, B, H), added to the base's partial sum *before* the
block's reduction: B (sum_r A_r x_r) = sum_r B A_r x_r, so the adapter rides the base's
collective. Reducing the adapter's output on its own path instead (all-reducing it, or adding it
after the reduce-scatter) either counts it N times or needs its own sequence-parallel
reduce-scatter; without one its gradient is silently wrong.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

import torch
import torch.nn.functional as F
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.other import AuxiliaryTrainingWrapper
from torch import nn

from distft.model import causal_lm
from distft.parallel.tensor_parallel import COLUMN, ROW
from distft.parallel.tp_experts import cut_experts

# The plan, as data: each decoder layer's projection paths and how their base weights are split.
PLAN: dict[str, str] = {**dict.fromkeys(COLUMN, "column"), **dict.fromkeys(ROW, "row")}


def shard(weight: nn.Parameter, dim: int | None, rank: int, world: int) -> nn.Parameter:
    """Rank `rank`'s contiguous slice of `weight` along `dim` (None: the weight itself, replicated).

    The slice is tagged with `partition_dim` (`tensor_parallel.partition_dim` reads it), which
    after_backward, the gradient norm and the export use, as Megatron-LM tags its parameters.
    """
    if dim is None:
        return weight
    part = nn.Parameter(weight.detach().chunk(world, dim)[rank].clone(), requires_grad=weight.requires_grad)
    part.partition_dim = dim
    return part


class _Weight(nn.Module):
    """Holds one weight (and the base's bias) under PEFT's module names (`base_layer`, `lora_A.default`, ...)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None):
        super().__init__()
        self.weight = weight
        self.bias = bias


class ParallelLinear(nn.Module):
    """One rank's shard of an `nn.Linear`, or of PEFT's LoRA `Linear`, under the same names.

    Parameter names stay those of the single-process model (`q_proj.weight`, or
    `q_proj.base_layer.weight`, `q_proj.lora_A.default.weight`, ...), so exporting is a gather per
    name. A bias (Qwen2's q/k/v) belongs to an output feature: a column layer splits it with its
    weight's rows. A row layer's output is a partial sum, where a bias would be added N times; no
    family distft trains has one there, and `shard_projections` refuses it.
    """

    weight_dim: ClassVar[int]  # dim of the base weight (out, in) split across ranks
    lora_A_dim: ClassVar[int | None]
    lora_B_dim: ClassVar[int | None]

    def __init__(self, source: nn.Module, rank: int, world: int):
        super().__init__()
        self.lora = hasattr(source, "base_layer")
        base = source.base_layer if self.lora else source
        bias = None if base.bias is None else shard(base.bias, 0, rank, world)
        if not self.lora:
            self.weight = shard(source.weight, self.weight_dim, rank, world)
            self.bias = bias
            return
        (self.adapter,) = source.active_adapters  # distft applies exactly one adapter
        a = self.adapter
        self.base_layer = _Weight(shard(base.weight, self.weight_dim, rank, world), bias)
        self.lora_A = nn.ModuleDict(
            {a: _Weight(shard(source.lora_A[a].weight, self.lora_A_dim, rank, world))}
        )
        self.lora_B = nn.ModuleDict(
            {a: _Weight(shard(source.lora_B[a].weight, self.lora_B_dim, rank, world))}
        )
        self.lora_dropout = source.lora_dropout  # Dropout or Identity: no parameters
        self.scaling = source.scaling[a]
        self.disable_adapters = False

    def enable_adapters(self, enabled: bool) -> None:
        """peft's switch (`PeftModel.disable_adapter` calls it on every tuner layer): off, the shard
        computes its base alone, as the DPO and KTO reference does."""
        self.disable_adapters = not enabled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.lora:
            return F.linear(x, self.weight, self.bias)
        out = F.linear(x, self.base_layer.weight, self.base_layer.bias)
        if self.disable_adapters:
            return out
        a = self.adapter
        lora = F.linear(F.linear(self.lora_dropout[a](x), self.lora_A[a].weight), self.lora_B[a].weight)
        return out + lora * self.scaling  # PEFT's order of operations, for bit-level parity


# PEFT's adapter export finds adapter weights by walking its tuner layers (an isinstance check),
# not by name. A virtual subclass passes that check without inheriting the tuner layer's
# machinery (its `weight` property would shadow the shard registered under that name).
BaseTunerLayer.register(ParallelLinear)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """peft's `PeftModel.disable_adapter` for a model whose projections are these shards: every
    tuner layer (the shards, and `lora.modules_to_save`'s wrappers) switched off and on as peft's
    own loop switches them; peft's context first reads tuner-layer state the shards do not carry."""
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer | AuxiliaryTrainingWrapper)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


class ColumnParallelLinear(ParallelLinear):
    """x: (S, B, in), full and replicated -> (S, B, out/N): this rank's output features, complete.

    LoRA: replicated lora_A gives the same (S, B, r) on every rank; lora_B, split on out like the
    base, gives this rank's features of the update.
    """

    weight_dim, lora_A_dim, lora_B_dim = 0, None, 0


class RowParallelLinear(ParallelLinear):
    """x: (S, B, in/N), this rank's input features -> (S, B, out): a partial sum the caller reduces.

    LoRA: lora_A, split on in like the base, gives a partial (S, B, r); replicated lora_B maps it to
    a partial (S, B, out) added to the base's, so one reduction completes both.
    """

    weight_dim, lora_A_dim, lora_B_dim = 1, 1, None


def shard_projections(lm: nn.Module, rank: int, world: int) -> list[nn.Parameter]:
    """Replace every decoder layer's projections in place by this rank's `PLAN` shards; a mixture
    of experts' MLP keeps this rank's features of every expert (`tp_experts.cut_experts`), whose
    shards it returns."""
    experts: list[nn.Parameter] = []
    for layer in causal_lm(lm).model.layers:
        moe = hasattr(layer.mlp, "experts")
        if moe:
            experts += cut_experts(layer.mlp.experts, rank, world)[0]
        for path, style in PLAN.items():
            if moe and path.startswith("mlp."):
                continue
            parent_path, name = path.rsplit(".", 1)
            parent = layer.get_submodule(parent_path)
            cls = ColumnParallelLinear if style == "column" else RowParallelLinear
            source = getattr(parent, name)
            if style == "row" and getattr(getattr(source, "base_layer", source), "bias", None) is not None:
                raise ValueError(
                    f"tp-sp: the row-parallel {path} has a bias, which a partial sum cannot carry"
                )
            setattr(parent, name, cls(source, rank, world))
    return experts
