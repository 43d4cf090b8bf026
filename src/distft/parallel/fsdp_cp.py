"""FSDP x context parallelism (`fsdp+cp`): sequences split over cp ranks, weights sharded over all.

`distft train --strategy fsdp+cp --nproc 4 parallel.cp=2`: a ("dp", "cp") mesh, cp innermost
(neighbouring ranks: they talk every layer). Ranks of one cp group read the same rows and each
holds 1/cp of every row's positions, exactly as under `cp` (`distft.parallel.context`: head and
mirrored tail chunks, K and V all-gathered per layer); the dp groups read distinct rows.

What each rank holds. FSDP2 shards every weight over all dp x cp ranks, the way torchtitan folds
CP into its shard dimension: 1/(dp cp) of the parameters, gradients and optimizer state, where
`cp` alone replicates the whole model on every rank. Activations: 1/cp of its rows' positions.

Which collectives run, and when (per micro-batch; `fsdp`'s and `cp`'s, on their groups):
- every rank: all-gather of each layer's parameter shards before its forward and again before its
  backward (ZeRO-3), reduce-scatter of its gradients after its backward. That reduce-scatter also
  sums what `cp` all-reduces once per step: each rank's gradient is its positions' share, and the
  shares of one row's cp ranks add up in the same sum as the dp replicas';
- cp group: per layer, K and V all-gathered in forward (again where checkpointing recomputes the
  layer), dK and dV reduce-scattered in backward;
- per step: the loss sum (fp32) and the gradient norm's sum of squares (float64) over every rank.

Gradient scale. FSDP2 averages the reduce-scattered sum over its dp x cp ranks; the cp shares
must add up, so each rank scales its loss by dp x cp (`averaged_over`), not dp, before backward.
"""

from __future__ import annotations

from torch import nn

from distft.config import Config
from distft.errors import ConfigError
from distft.layout import ParallelDims
from distft.model import causal_lm
from distft.parallel.context.model import ContextParallelLM
from distft.parallel.context.strategy import ContextSplit
from distft.parallel.dims import build_mesh
from distft.parallel.fsdp import FSDP, shard_units


class FSDPContextParallel(ContextSplit, FSDP):
    name = "fsdp+cp"

    @classmethod
    def validate_config(cls, cfg: Config) -> None:
        super().validate_config(cfg)
        p = cfg.parallel
        if p.tp != 1 or p.pp != 1:
            raise ConfigError(
                f"--strategy fsdp+cp takes parallel.dp and parallel.cp; parallel.tp={p.tp} and "
                f"parallel.pp={p.pp} must stay 1."
            )
        if ParallelDims.of(cls.spec, cfg).cp < 2:
            raise ConfigError(
                "--strategy fsdp+cp with parallel.cp=1 splits no sequence: that is --strategy fsdp. Set "
                "parallel.cp to 2 or more (it must divide --nproc x --nnodes)."
            )

    def __init__(self, cfg: Config, env) -> None:
        super().__init__(cfg, env)
        self.averaged_over = env.world_size  # FSDP averages over dp x cp; the cp shares must add up

    def parallelize(self, model: nn.Module) -> nn.Module:
        model.to(self.env.device)
        # ("dp", "cp"), and "dp_cp" flattened
        self.mesh, self.flattened = build_mesh(self.spec, self.dims, self.env.device.type)
        context = ContextParallelLM(model, self.mesh.get_group("cp"), self.cfg.parallel.cp_method)
        layers = causal_lm(model.lm).model.layers
        # The CP wrapper is FSDP's root: its forward (not the `LossLM`'s) gathers what the layers leave.
        shard_units(context, layers, self.flattened["dp_cp"], self.cfg, reshard_after_forward=True)
        return context
