"""Fully sharded data parallel (FSDP2 `fully_shard`): ZeRO-3 (`fsdp`) and ZeRO-2 (`zero2`).

What each rank holds: 1/N of every parameter (dim-0 shards, padded to a multiple of N), 1/N of
every gradient, and the optimizer state of its shards only. Each Qwen3 decoder layer is one
sharding unit; the root unit holds what is left (embeddings, final norm and the lm_head, which
Qwen3 ties to the embeddings, so both must sit in the same unit). Frozen base weights and
trainable LoRA weights of a layer share its unit: both are gathered for compute, only the
trainable ones get gradients and optimizer state.

Which collectives run, and when (per micro-batch, per unit):
- forward: all-gather the unit's parameters just before it runs (the next `fsdp_prefetch` units'
  all-gathers are issued early, to overlap compute); after it runs, ZeRO-3 frees the gathered
  copy (`reshard_after_forward=True`), ZeRO-2 keeps it until backward (`False`);
- backward: ZeRO-3 all-gathers the unit again; then the gradients of its trainable parameters
  are reduce-scattered, each rank keeping the averaged gradient of its own shard.
Gradients are reduce-scattered after every micro-batch, so they stay sharded during accumulation
(the point of ZeRO) at the cost of one reduce-scatter per micro-batch. So ZeRO-3 gathers the parameters twice per micro-batch and ZeRO-2 once, trading memory (ZeRO-2
keeps every layer's full parameters alive between forward and backward) for traffic. Frozen
weights travel too: with LoRA, the all-gathers carry the whole base model (the embedding table
first of all) while the reduce-scatters carry only the adapters' gradients.

Mixed precision has three separate dtypes (`MixedPrecisionPolicy`): the dtype parameters are
gathered and computed in, the dtype gradients are reduce-scattered in (summing many bf16
gradients loses precision: float32 is the safe choice), and the dtype of the root's outputs.
The sharded parameters and the optimizer keep the model dtype.

QLoRA (`--method qlora`): the NF4 base weights are torchao NF4Tensors, which FSDP2 shards and
gathers through their `fsdp_pre/post_all_gather` hooks: a unit's all-gather carries the 4-bit codes
and 8-bit block scales (about 0.52 bytes per weight instead of 2 or 4), and every rank stores 1/N
of them. Why this usually fails with bitsandbytes, and what it requires: `distft.model.nf4`.

Paper: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (1910.02054); Zhao et al., "PyTorch FSDP" (2304.11277).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from distft.config import Config
from distft.errors import ConfigError
from distft.model import DTYPES, causal_lm
from distft.parallel.base import Strategy
from distft.parallel.dims import build_mesh


def mixed_precision(cfg: Config, masters: bool = False) -> MixedPrecisionPolicy:
    """FSDP's dtypes: parameters gathered and computed in `fsdp_param_dtype` (empty: as stored;
    with fp32 `masters` of a bf16 model, bf16), gradients reduce-scattered in `fsdp_reduce_dtype`
    (empty: the param dtype; fp32 over masters), outputs cast to `fsdp_output_dtype` (empty: left
    as computed)."""
    p = cfg.parallel
    param_dtype = DTYPES[p.fsdp_param_dtype] if p.fsdp_param_dtype else (torch.bfloat16 if masters else None)
    reduce_default = torch.float32 if masters else param_dtype
    reduce_dtype = DTYPES[p.fsdp_reduce_dtype] if p.fsdp_reduce_dtype else reduce_default
    output_dtype = DTYPES[p.fsdp_output_dtype] if p.fsdp_output_dtype else None
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=output_dtype)


def fsdp_settings(root: nn.Module, mesh: DeviceMesh, cfg: Config, reshard_after_forward: bool) -> dict:
    """`fully_shard`'s arguments for every unit of `root` over `mesh`: the run's dtypes, offload and
    resharding."""
    # fp32 trainable weights of a bf16 full finetune: the master weights (`train.master_weights`).
    masters = cfg.train.method == "full" and cfg.model.dtype == "bfloat16"
    masters = masters and any(w.dtype == torch.float32 for w in root.parameters() if w.requires_grad)
    return {
        "mesh": mesh,
        "mp_policy": mixed_precision(cfg, masters),
        "offload_policy": CPUOffloadPolicy() if cfg.parallel.fsdp_cpu_offload else OffloadPolicy(),
        "reshard_after_forward": reshard_after_forward,
    }


def shard_units(
    root: nn.Module,
    layers: Iterable[nn.Module],
    mesh: DeviceMesh,
    cfg: Config,
    reshard_after_forward: bool,
    ignored: set[nn.Parameter] | None = None,
    inner: list[nn.Module] | None = None,
) -> nn.Module:
    """`fully_shard` each of the decoder `layers`, then `root` (what is left: embeddings, final norm,
    the (tied) lm_head), over `mesh`; set up prefetching. `mesh`: every rank (`fsdp`, `zero2`), the
    "dp" dimension after tensor parallelism, so that FSDP shards each rank's TP shard (`fsdp+tp`), or
    a 2D ("replicate", "shard") one, sharded over the inner dimension and replicated over the outer
    (`hsdp`); the pipelines call it once per stage, `root` being the stage. `ignored`: parameters
    another dimension holds (`fsdp+ep`'s experts), left as they are; `inner`: a unit already sharded
    inside each layer (`fsdp+ep`'s experts across its groups), gathered as its layer starts."""
    p = cfg.parallel
    # parallel.fsdp_wrap=model: the root is the only unit, gathered whole before forward.
    layers = list(layers) if p.fsdp_wrap == "layer" else []
    shard = fsdp_settings(root, mesh, cfg, reshard_after_forward) | {"ignored_params": ignored}
    for layer in layers:
        fully_shard(layer, **shard)
    fully_shard(root, **shard)

    # Issue the all-gathers of the next layers early, so they overlap this layer's compute.
    if (p.fsdp_prefetch or inner) and layers:
        for i, layer in enumerate(layers):
            own = [inner[i]] if inner else []
            layer.set_modules_to_forward_prefetch([*own, *layers[i + 1 : i + 1 + p.fsdp_prefetch]])
            layer.set_modules_to_backward_prefetch(layers[max(0, i - p.fsdp_prefetch) : i][::-1])
    return root


class FSDP(Strategy):
    name = "fsdp"

    @classmethod
    def validate_config(cls, cfg: Config) -> None:
        p = cfg.parallel  # its dtypes' values: `config.fields` (refused under every strategy)
        if p.fsdp_prefetch < 0:
            raise ConfigError(f"`parallel.fsdp_prefetch` cannot be negative, got {p.fsdp_prefetch}.")
        if cfg.train.method == "qlora" and cfg.world_size == 1:
            # FSDP2 skips the real all-gather on one rank and torchao's NF4 post-all-gather hook
            # then fails ("expected 3, got 1"); one rank shards nothing anyway.
            raise ConfigError(
                f"--method qlora with --strategy {cls.name} needs 2 or more processes (FSDP over one rank "
                "shards nothing, and torchao's NF4 gather hook fails there): use --strategy single."
            )

    @classmethod
    def nf4_shards(cls, cfg: Config) -> int:
        return cfg.world_size

    def parallelize(self, model: nn.Module) -> nn.Module:
        model.to(self.env.device)
        mesh, _ = build_mesh(self.spec, self.dims, self.env.device.type)  # ("dp",)
        layers = causal_lm(model.lm).model.layers
        return shard_units(model, layers, mesh, self.cfg, self.spec.reshard_after_forward)


class ZeRO2(FSDP):
    """ZeRO-2: gradients and optimizer state sharded; parameters stay gathered from forward to backward."""

    name = "zero2"

    def release_gathered(self, model: nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
