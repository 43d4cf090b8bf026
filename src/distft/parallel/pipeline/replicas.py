"""Pipelines repeated across a mesh: what `ddp+pp`, `fsdp+pp` and `fsdp+tp+pp` share.

The ranks form one `DeviceMesh` (`distft.layout.ParallelDims`), pp outermost: ("pp", "dp")
or ("pp", "dp", "tp"). Every column of the mesh along pp, one per (dp, tp) coordinate, is one
pipeline: the `pp` strategy (`PipelineParallel`: stages, schedules, loss, timeline, export) over
those ranks, its sends and receives on mesh["pp"]. The ranks of one dp index read the same 1/dp
of the global batch; the layout cuts that share into the schedule's micro-batches.

What the subclasses add is what happens across the columns: `ddp+pp` all-reduces the stage
gradients over dp after the schedule; `fsdp+pp` shards each stage over dp with FSDP2; `fsdp+tp+pp`
also splits each stage's layers over tp first.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from distft.config import Config
from distft.errors import ConfigError
from distft.layout import ParallelDims
from distft.parallel.dims import build_mesh
from distft.parallel.pipeline.layout import Layout, layout
from distft.parallel.pipeline.strategy import PipelineParallel


class MeshPipeline(PipelineParallel):
    @classmethod
    def pipeline_layout(cls, cfg: Config) -> Layout:
        dims = ParallelDims.of(cls.spec, cfg)
        return layout(cfg, ranks=dims.pp, replicas=dims.dp)

    @classmethod
    def validate_config(cls, cfg: Config) -> None:
        dims = ParallelDims.of(cls.spec, cfg)  # dp x tp x pp = world size, else a ConfigError
        name, world = cls.name, cfg.world_size
        if "tp" not in cls.spec.dims and dims.tp != 1:
            with_tp = "; for tensor parallelism inside each stage use --strategy fsdp+tp+pp"
            raise ConfigError(
                f"--strategy {name} takes parallel.dp and parallel.pp; parallel.tp must be 1 (got {dims.tp})"
                f"{with_tp if 'fsdp' in name else ''}."
            )
        if "tp" in cls.spec.dims and dims.tp < 2:
            raise ConfigError(
                f"--strategy {name} needs parallel.tp of 2 or more (it is {dims.tp}); with one TP rank it is "
                f"--strategy fsdp+pp."
            )
        if dims.pp < 2:
            raise ConfigError(
                f"--strategy {name} needs parallel.pp of 2 or more (it is {dims.pp}); with one pipeline rank "
                f"it is plain {cls.spec.without_pp}: use --strategy {cls.spec.without_pp}, or e.g. --nproc {world} "
                "parallel.pp=2."
            )
        if cls.spec.without_dp and dims.dp < 2:
            raise ConfigError(
                f"--strategy {name} with parallel.dp=1 is a single pipeline: use --strategy {cls.spec.without_dp} "
                f"--nproc {world}, or raise --nproc to a multiple of parallel.pp={dims.pp}."
            )
        super().validate_config(cfg)

    def parallelize(self, model: nn.Module) -> nn.Module:
        # ("pp", "dp"[, "tp"])
        self.mesh, self.flattened = build_mesh(self.spec, self.dims, self.env.device.type)
        self.dp_group = self.mesh["dp"].get_group()
        view = super().parallelize(model)
        assert dist.get_process_group_ranks(self.pp_group) == self.pp_ranks
        return view

    def pipelines(self) -> list[list[int]]:
        """Each (dp, tp) column of the mesh: one pipeline's global ranks, by pipeline rank."""
        ranks = self.mesh.mesh.reshape(self.dims.pp, -1)  # (pp, dp x tp) global ranks
        return [ranks[:, j].tolist() for j in range(ranks.shape[1])]

    def pipeline_group(self) -> dist.ProcessGroup:
        return self.mesh["pp"].get_group()
