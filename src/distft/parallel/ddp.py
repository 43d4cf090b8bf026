"""Distributed data parallel (DDP): replicate the model, split the batch, all-reduce gradients.

What each rank holds: the whole model, the whole gradient of every trainable parameter, and the
whole optimizer state. Nothing is sharded; DDP buys throughput, never memory.

Which collectives run, and when:
- construction: one broadcast of rank 0's trainable parameters, so every replica starts equal;
- backward of the last micro-batch of a step: as soon as every gradient in a bucket
  (`parallel.ddp_bucket_mb`) is ready, an autograd hook launches an all-reduce of that bucket, so
  communication overlaps the rest of backward. Bytes per optimizer step: the trainable gradient
  bytes, once (for LoRA, a few MB; for full finetuning, the whole model);
- backward of the other micro-batches: nothing; they run under `no_sync()` and gradients pile up
  locally, so accumulation costs no extra communication.

Settings that silently cost speed (guarded here):
- `find_unused_parameters=True` walks the autograd graph after every forward to find parameters
  that got no gradient. Frozen base weights are not "unused" (DDP never tracks parameters that do
  not require grad), so with LoRA every tracked parameter is used and the walk is pure overhead.
- `forward_sync_buffers=True` (DDP's default) re-broadcasts every buffer before every forward; Qwen3's
  only buffers are rotary tables that never change, so it is off.
- all-reducing on every micro-batch instead of once per step (forgetting `no_sync`) multiplies the
  traffic by the accumulation count.
- `gradient_as_bucket_view=True` lets gradients live inside the communication buckets, saving one
  copy of the gradients in memory and a copy per step.

QLoRA: the NF4 base weights are left out of DDP (`_set_params_and_buffers_to_ignore_for_model`).
DDP would broadcast them from rank 0 at construction, and torchao implements that copy by
re-quantizing the dequantized weight: a silently different base on every rank. Each rank
quantizes the same seeded weights itself, bit for bit, so nothing needs broadcasting.

Paper: Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training" (2006.15704).
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distft.config import Config
from distft.errors import ConfigError
from distft.model.nf4 import nf4_parameter_names
from distft.parallel.base import Strategy, unwrap


class DDP(Strategy):
    name = "ddp"

    @classmethod
    def validate_config(cls, cfg: Config) -> None:
        accumulation = cfg.train.global_batch_size // (cfg.train.micro_batch_size * cfg.world_size)
        if cfg.parallel.ddp_static_graph and accumulation > 1:
            raise ConfigError(
                "parallel.ddp_static_graph=true cannot be combined with gradient accumulation "
                f"({accumulation} micro-batches per step): a static graph expects every backward to "
                "all-reduce, and DDP's reducer fails on the first backward under no_sync(). Raise "
                "train.micro_batch_size to global_batch_size / ranks, or leave the static graph off."
            )

    def parallelize(self, model: nn.Module) -> nn.Module:
        model = model.to(self.env.device)
        p = self.cfg.parallel
        quantized = nf4_parameter_names(model)
        if quantized:  # identical on every rank already; a broadcast would re-quantize them
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, quantized)
        return DistributedDataParallel(
            model,
            device_ids=[self.env.device.index] if self.env.device.type == "cuda" else None,
            bucket_cap_mb=p.ddp_bucket_mb,
            gradient_as_bucket_view=p.ddp_gradient_as_bucket_view,
            # Both off by default: see the module docstring; on only to measure what they cost.
            forward_sync_buffers=p.ddp_broadcast_buffers,
            find_unused_parameters=p.ddp_find_unused_parameters,
            # The graph is the same every step (same layers, same adapters), which lets DDP fix
            # its bucket order after the first iteration; incompatible with no_sync() (see above).
            static_graph=p.ddp_static_graph,
        )

    def traffic_facts(self, model: nn.Module) -> dict:
        """The buffers `ddp_broadcast_buffers` sends, and the buckets after DDP's rebuild."""
        buffers = sum(b.numel() * b.element_size() for b in unwrap(model).buffers())
        return {"buffer_bytes": buffers, "buckets": len(model.reducer._get_zeros_like_grad_buckets())}

    def accumulating(self, model: nn.Module, last_micro_batch: bool) -> contextlib.AbstractContextManager:
        if last_micro_batch or not self.cfg.parallel.ddp_no_sync:
            return contextlib.nullcontext()  # ddp_no_sync=false: all-reduce after every micro-batch
        return model.no_sync()
