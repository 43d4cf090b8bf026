"""Hybrid sharded data parallel (`hsdp`): FSDP inside each node, replicas across nodes.

The ranks form a 2D `DeviceMesh` ("replicate", "shard"): `parallel.shard` consecutive ranks (a
node: 0 means --nproc) shard each parameter between them, FSDP2 style, and the world / shard such
groups are replicas of each other, each reading its own part of the global batch (every rank reads
distinct data: the data-parallel degree is the world size). With 2 nodes of 2 ranks, {0, 1} and
{2, 3} are the shard groups, {0, 2} and {1, 3} the replicate groups. `fully_shard` takes the 2D
mesh as is (`fsdp.shard_units`); each parameter becomes a DTensor placed (Replicate(), Shard(0)).

What each rank holds: 1/shard of every parameter (dim-0 shards, padded to a multiple of shard), of
every gradient, and the optimizer state of its shards: memory as FSDP over one node, whatever the
number of nodes.

Which collectives run, on which dimension (per micro-batch, per unit, as in `fsdp`):
- shard (inside a node): all-gather of the unit's parameters before its forward and again before
  its backward (ZeRO-3), reduce-scatter of its trainable gradients after its backward; logical
  bytes per step: 2 m P + m G (P: the parameters' bytes, G: the trainable gradients', padded to a
  multiple of shard rows; m micro-batches);
- replicate (across nodes): once per optimizer step, after the last micro-batch's backward, an
  all-reduce of each rank's reduce-scattered gradient shard: G / shard bytes. The earlier
  micro-batches leave their reduce-scattered shards unreduced across replicas
  (`set_requires_all_reduce(False)`, the analogue of DDP's `no_sync`), so accumulation adds no
  traffic between nodes;
- world: the loss (fp32) and the gradient norm's sum of squares (float64).
Plain FSDP over all the ranks of several nodes moves 2 m P + m G through rings that cross the
inter-node link (about 10x slower than NVLink); HSDP moves only G / shard across it, once per
step, and pays for it with shard-degree memory instead of world-degree (docs/hsdp.md).

QLoRA: the NF4 base weights shard over the shard dimension as under `fsdp` (torchao's
`fsdp_pre/post_all_gather`) and are replicated across replicas: each rank quantizes the same
seeded weights itself, so the replicas hold the same codes without a broadcast.

Papers: Zhao et al., "PyTorch FSDP" (2304.11277), section 3.2.2 (hybrid sharding); ZeRO (1910.02054).
"""

from __future__ import annotations

import contextlib

from torch import nn

from distft.config import Config
from distft.errors import ConfigError
from distft.layout import ParallelDims
from distft.model import causal_lm
from distft.parallel.dims import build_mesh
from distft.parallel.fsdp import FSDP, shard_units


class HSDP(FSDP):
    name = "hsdp"

    @classmethod
    def validate_config(cls, cfg: Config) -> None:
        super().validate_config(cfg)
        # parallel.shard (a node's processes by default) must divide them (`ParallelDims.split`).
        shard, world = ParallelDims.of(cls.spec, cfg).dp_shard, cfg.world_size
        if shard == world:
            raise ConfigError(
                f"--strategy hsdp with parallel.shard = {shard} = every process has a single replica: it is "
                f"plain FSDP. Use --strategy fsdp, or a smaller parallel.shard (e.g. --nproc {cfg.parallel.nproc} "
                f"--nnodes 2, or parallel.shard={world // 2})."
            )
        if shard == 1:
            raise ConfigError(
                "--strategy hsdp with parallel.shard=1 shards nothing (every rank holds the whole model): "
                "use --strategy ddp, or parallel.shard of 2 or more."
            )

    @classmethod
    def nf4_shards(cls, cfg: Config) -> int:
        return ParallelDims.of(cls.spec, cfg).dp_shard

    def parallelize(self, model: nn.Module) -> nn.Module:
        model.to(self.env.device)
        # ("replicate", "shard"), and "dp" flattened. Row-major: the shard dimension is the inner one,
        # so a shard group is consecutive ranks (a node).
        self.mesh, self.flattened = build_mesh(self.spec, self.dims, self.env.device.type)
        layers, mesh = causal_lm(model.lm).model.layers, self.mesh["replicate", "shard"]
        return shard_units(model, layers, mesh, self.cfg, reshard_after_forward=True)

    def accumulating(self, model: nn.Module, last_micro_batch: bool) -> contextlib.AbstractContextManager:
        # Reduce-scatter inside the node every micro-batch (gradients stay sharded); all-reduce
        # across the replicas only after the last one.
        model.set_requires_all_reduce(last_micro_batch)
        return contextlib.nullcontext()
