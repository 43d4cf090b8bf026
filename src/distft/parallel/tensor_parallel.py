"""Tensor parallelism with PyTorch's own `parallelize_module` (DTensor), made to carry LoRA.

What each rank holds: a slice of every projection inside every decoder layer, and a full copy of
everything else (embeddings, norms, lm_head, the residual stream). A `Linear` weight is
(out, in) in torch's convention:
- q_proj, k_proj, v_proj, gate_proj, up_proj are column-parallel: sharded on `out` (dim 0), so
  each rank computes its own attention heads (and KV heads) and its own slice of the MLP;
- o_proj and down_proj are row-parallel: sharded on `in` (dim 1), so each rank turns its heads /
  MLP slice into a partial sum of the full output.
Every rank reads the same batch; there is no data parallelism here.

Which collectives run, and when (per decoder layer, per micro-batch):
- forward: an all-reduce of the (batch, seq, hidden) partial sums after o_proj and after
  down_proj, and, with LoRA, of the (batch, seq, r) partial sums after their lora_A;
- backward: the conjugate all-reduces of activation gradients where the replicated residual
  stream enters a column-parallel projection. `ColwiseParallel` converts its input on its own,
  so PyTorch issues one per projection (q, k, v, gate, up, and each colwise lora_B: 5 + 5 per
  layer), where Megatron's hand-written version (`tp-sp`) needs one per block (2 per layer).
Biases (Qwen2's q/k/v) are split with their column-parallel weight: each rank adds its features' share.

The collision with PEFT, and how it is resolved here. PEFT's LoRA layer computes
`base_layer(x) + lora_B(lora_A(x)) * scale`, adding plain tensors. `ColwiseParallel` accepts only
`nn.Linear`, so it cannot wrap PEFT's layer; aimed at `base_layer` alone, the base output is a
local shard (out/N) while the LoRA path is full-size (out): the add fails. Keeping DTensors
(`use_local_output=False`) fails differently: LoRA's plain weights meet a DTensor input. What
works is to shard each adapter together with its base, so both paths produce the same layout:
- column-parallel base: lora_A replicated (r x in), lora_B column-parallel (out/N x r);
- row-parallel base: lora_A row-parallel (r x in/N, its partial sums all-reduced),
  lora_B replicated (out x r).
PEFT is applied first, then the plan shards `base_layer` and the adapter inside each wrapper.

Which gradients are partial. Qwen3's q_norm / k_norm weights (the other families have none) are replicated but applied to this
rank's heads only: their gradients are partial sums and are all-reduced after backward
(`after_backward`; they train only in full finetuning). lora_A of a column-parallel projection
looks similar but is not: lora_B's input is converted to a replicated DTensor, whose backward
all-reduces the gradient flowing into lora_A's output, so lora_A's gradient is already complete.
All-reducing it again doubles it, an error AdamW's scale invariance all but hides in the weights;
the parity tests compare gradient norms for that reason.

A mixture of experts (Qwen3-MoE) keeps its attention plan; its MLP is a router and two fused
expert stacks, not Linear layers. Each rank keeps every expert's 1/N of the intermediate dimension
(gate_up_proj's gate and up rows, down_proj's columns, and their adapters cut with them) as
plain tensors, and the router whole. Per MoE layer: one all-reduce of the experts' output
forward; in backward one of the gradient of their input and of the routing weights; after
backward, the partial gradients of gate_up's lora_A and down's lora_B. Details in `tp_experts.py`.

Paper: Shoeybi et al., "Megatron-LM" (1909.08053).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from transformers import PretrainedConfig

from distft.config import Config
from distft.errors import ConfigError
from distft.layout.rules import tp_split
from distft.model import causal_lm
from distft.model.families import PROJECTIONS
from distft.parallel.base import Strategy
from distft.parallel.dims import build_mesh
from distft.parallel.tp_experts import ExpertShards, expert_split, split_layers, tagged
from distft.tensors import local

# Which projections of a decoder layer are column- and row-parallel, from the families' one
# description (tp, tp-sp, fsdp+tp and the planner read them). Column: weight split on out (dim 0);
# row: on in (dim 1).
COLUMN = tuple(path for path, style in PROJECTIONS if style == "column")
ROW = tuple(path for path, style in PROJECTIONS if style == "row")


def partition_dim(p: torch.Tensor) -> int | None:
    """The dimension along which `p` is a plain-tensor TP shard (None: not one).

    tp-sp's shards are plain tensors tagged with `partition_dim`, as Megatron-LM tags its
    parameters; the DTensor shards of tp and fsdp+tp carry their placements instead.
    """
    return getattr(p, "partition_dim", None)


def check_tp_degree(cfg: Config, model_config: PretrainedConfig, n: int, knob: str) -> None:
    """ConfigError unless `n` TP ranks can split the heads and the MLP; `knob` names the setting
    that picks `n` (`--nproc ` or `parallel.tp=`), for the suggestion."""
    heads, kv_heads = model_config.num_attention_heads, model_config.num_key_value_heads
    mlps = {"intermediate_size": model_config.intermediate_size}
    if experts := getattr(model_config, "moe_intermediate_size", 0):  # a mixture of experts (`tp_experts`)
        mlps["moe_intermediate_size"] = experts
    why, strategy, name = tp_split(n, heads, kv_heads, mlps), cfg.parallel.strategy, cfg.model.name
    if why.endswith("must divide both"):
        fits = next(d for d in range(n, 0, -1) if heads % d == 0 and kv_heads % d == 0)
        raise ConfigError(
            f"--strategy {strategy} splits attention heads across {n} ranks, but {name} has {why} (e.g. {knob}{fits})."
        )
    if why:
        raise ConfigError(f"--strategy {strategy} splits the MLP across {n} ranks, but {name}'s {why}.")


def sum_partial_gradients(params: list[nn.Parameter], group: dist.ProcessGroup | None = None) -> None:
    """After backward: the gradients of `params` (`partial_gradient_params`), each TP rank's only
    its heads' (its experts' features') part, summed over the TP group in place (under FSDP, the
    rank's own shard of each)."""
    for p in params:
        if p.grad is not None:
            dist.all_reduce(local(p.grad), group=group)


def partial_gradient_params(scope: Iterable[nn.Module]) -> list[nn.Parameter]:
    """Trainable parameters in `scope` that every TP rank holds whole but applies to its own share
    only (its heads, its sequence shard, its partial sum): each rank's gradient is a partial sum,
    to be summed over the TP group after backward. Tied weights count once.

    Which modules hold such parameters depends on how the strategy routes activations, so each
    strategy passes its scope: tp and fsdp+tp `head_norms` (DTensor's replicated input to a
    column lora_B makes lora_A's gradient complete); tp-sp every block, or with sequence
    parallelism the whole model (`megatron/strategy.py`).
    """
    params = {id(p): p for m in scope for p in m.parameters()}
    return [
        p for p in params.values() if p.requires_grad and partition_dim(p) is None and expert_split(p) is None
    ]


def head_norms(layers: Iterable[nn.Module]) -> list[nn.Module]:
    """The q_norm / k_norm of each layer (Qwen3's; Llama, Qwen2 and Mistral have none): replicated,
    applied to this rank's heads only."""
    return [
        getattr(layer.self_attn, name)
        for layer in layers
        for name in ("q_norm", "k_norm")
        if hasattr(layer.self_attn, name)
    ]


def layer_plan(layer: nn.Module) -> dict[str, ParallelStyle]:
    """The plan for one decoder layer, as data: module path -> how it is sharded."""
    plan: dict[str, ParallelStyle] = {}
    moe = hasattr(layer.mlp, "experts")  # a router and expert stacks: `tp_experts`, not a plan
    for path in COLUMN + ROW:
        if moe and path.startswith("mlp."):
            continue
        module = layer.get_submodule(path)
        colwise = path in COLUMN
        if hasattr(module, "base_layer"):  # a PEFT LoRA layer: shard the adapter with its base
            plan[f"{path}.base_layer"] = ColwiseParallel() if colwise else RowwiseParallel()
            for adapter in module.lora_A:
                if colwise:
                    plan[f"{path}.lora_B.{adapter}"] = ColwiseParallel()  # lora_A stays replicated
                else:
                    plan[f"{path}.lora_A.{adapter}"] = RowwiseParallel()  # lora_B stays replicated
        else:
            plan[path] = ColwiseParallel() if colwise else RowwiseParallel()
    return plan


class TensorParallel(ExpertShards, Strategy):
    name = "tp"

    @classmethod
    def validate_model(cls, cfg: Config, model_config: PretrainedConfig) -> None:
        check_tp_degree(cfg, model_config, cfg.world_size, knob="--nproc ")

    def parallelize(self, model: nn.Module) -> nn.Module:
        model.to(self.env.device)
        self.mesh, self.flattened = build_mesh(self.spec, self.dims, self.env.device.type)  # ("tp",)
        layers = causal_lm(model.lm).model.layers
        for layer in layers:
            parallelize_module(layer, self.mesh, layer_plan(layer))
        splits, partial = split_layers(model, layers, self.mesh)
        self.expert_shards, self.expert_mesh = tagged(model, splits), self.mesh
        self.partial_grads = partial_gradient_params(head_norms(layers))
        self.partial_grads += [p for name, p in model.named_parameters() if name in partial]
        return model

    def after_backward(self, model: nn.Module) -> None:
        sum_partial_gradients(self.partial_grads)  # each rank saw only its heads (its experts' features)

    def reduce_loss(self, local_sum: torch.Tensor) -> torch.Tensor:
        return local_sum  # every rank computed the same, full loss
