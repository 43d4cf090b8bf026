"""HSDP x tensor parallelism (`hsdp+tp`): TP inside each group of `tp` neighbouring ranks, FSDP2
across the TP groups of a node, replicas across nodes (torchtitan's dp_replicate x dp_shard x tp).

`distft train --strategy hsdp+tp --nproc 4 --nnodes 2 parallel.tp=2`: each node's 4 ranks are 2 TP
groups; FSDP shards each TP rank's slice across the node's 2 groups (`parallel.shard`, by default
a node's data-parallel ranks), and the 2 nodes are replicas, each reading its own rows.

The ranks form a ("replicate", "shard", "tp") `DeviceMesh` (`parallel/dims.py`: tp innermost, then
the shard group, the replicas outermost). Built as `fsdp+tp` is (`fsdp_tp.py`, whose strategy this
one extends): TP per layer on mesh["tp"] first, then FSDP2 on the 2D mesh["replicate", "shard"],
which shards over "shard" and replicates over "replicate", as `hsdp` does.

What each rank holds: 1/(shard tp) of each projection (and its TP-split adapter), 1/shard of the
rest, their gradients and AdamW state; with shard = 1, each TP group holds its slices whole and the
replicas are DDP x TP.

Which collectives run, on which dimension (per micro-batch unless said):
- tp (inside a node): TP's activation all-reduces, as under `fsdp+tp`;
- shard (inside a node): FSDP's all-gathers of each layer's TP-local parameters (forward and
  backward) and reduce-scatters of its gradients;
- replicate (across nodes): once per step, after the last micro-batch, an all-reduce of each
  rank's gradient shard (`set_requires_all_reduce`, as under `hsdp`): 1/(shard tp) of the trained
  gradients per rank;
- dp (replicate x shard, flattened): the loss sum; the world: the gradient norm's sum of squares.
Against `fsdp+tp` over the same ranks, the gathers stay inside the node and only the gradient
shards cross nodes, once per step; against `hsdp`, each node's activations and weights split tp ways.

Papers: Megatron-LM (1909.08053); PyTorch FSDP (2304.11277, hybrid sharding); torchtitan (2410.06511).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from distft.config import Config
from distft.errors import ConfigError
from distft.layout import ParallelDims
from distft.parallel.fsdp_tp import FSDPTensorParallel
from distft.parallel.hsdp import HSDP


class HSDPTensorParallel(FSDPTensorParallel):
    name = "hsdp+tp"

    @classmethod
    def validate_config(cls, cfg: Config) -> None:
        super().validate_config(cfg)
        dims = ParallelDims.of(cls.spec, cfg)
        if dims.dp_replicate < 2:
            raise ConfigError(
                f"--strategy hsdp+tp with parallel.shard = {dims.dp_shard} = every data-parallel rank has a "
                "single replica: it is --strategy fsdp+tp. Use it, or a smaller parallel.shard (e.g. one "
                "node's data-parallel ranks, --nproc / parallel.tp)."
            )

    def data_mesh(self) -> DeviceMesh:
        return self.mesh["replicate", "shard"]

    # Reduce-scatter inside the node every micro-batch; all-reduce across replicas after the last.
    accumulating = HSDP.accumulating
