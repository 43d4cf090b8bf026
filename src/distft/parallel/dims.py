"""The topology of a multi-dimensional run: degrees per dimension, validated, and one DeviceMesh.

`ParallelDims` holds the data-parallel (`dp`), tensor-parallel (`tp`), pipeline (`pp`, taken
by ddp+pp, fsdp+pp and fsdp+tp+pp; 1 elsewhere) and context-parallel (`cp`: each sequence's positions
split over the ranks; 1 but for cp) degrees. Their product must equal the world size;
`dp=0` means "whatever is left" (world / (tp x pp)). Validation runs in `__post_init__`, so a
`ParallelDims` that exists is consistent, and the CLI checks it before any process is launched.

Ranks are laid out row-major over (pp, dp, tp), tp fastest: with dp=2 x tp=2, ranks {0, 1} form
the TP group of data shard 0 and {2, 3} that of shard 1, while {0, 2} and {1, 3} are the FSDP
groups. TP exchanges activations every layer and FSDP weights once per layer, so TP gets the
neighbouring ranks (the same node, NVLink), as in torchtitan and Megatron-LM. pp is the outermost
dimension: with dp=2 x pp=2, ranks {0, 2} and {1, 3} are the two pipelines and {0, 1}, {2, 3} the
data-parallel groups of pipeline ranks 0 and 1; a stage boundary sends one activation per
micro-batch, the cheapest traffic, so it may cross nodes (torchtitan's order too).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from distft.config import Config
from distft.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    """Data-parallel degree: ranks reading distinct data (FSDP shards across them)."""
    tp: int
    """Tensor-parallel degree: ranks sharing each layer (and each batch)."""
    pp: int
    """Pipeline degree: ranks a model is cut across in stages (the pipeline strategies; 1 for every other)."""
    world_size: int
    cp: int = 1
    """Context-parallel degree: ranks sharing each sequence, each holding 1/cp of its positions."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"`parallel.{name}` must be at least 1, got {getattr(self, name)}.")
        if self.dp * self.tp * self.pp * self.cp != self.world_size:
            cp_name, cp = (" x parallel.cp", f" x {self.cp}") if self.cp > 1 else ("", "")
            raise ConfigError(
                f"parallel.dp x parallel.tp x parallel.pp{cp_name} = {self.dp} x {self.tp} x {self.pp}{cp} = "
                f"{self.dp * self.tp * self.pp * self.cp}, but the run has {self.world_size} processes "
                "(--nproc x --nnodes). The degrees must multiply to the world size; parallel.dp=0 takes "
                "what is left."
            )

    @classmethod
    def of(cls, strategy_dims: tuple[str, ...], cfg: Config) -> ParallelDims:
        """The degrees a strategy spanning `strategy_dims` (`Strategy.dims`) runs `cfg` with: the
        user's parallel.dp / tp / pp / cp on several dimensions, every rank on its one dimension, or
        one process. The runtime's mesh and the planner (`plan.auto.parallelism_of`) both read it."""
        if len(strategy_dims) > 1:
            return cls.from_config(cfg, context="cp" in strategy_dims)
        world = cfg.world_size
        degrees = {"dp": 1, "tp": 1, "pp": 1, "cp": 1} | {d: world for d in strategy_dims}
        return cls(**degrees, world_size=world if strategy_dims else 1)

    @classmethod
    def from_config(cls, cfg: Config, context: bool = False) -> ParallelDims:
        """The degrees a multi-dimensional strategy runs with (parallel.dp / tp / pp, and cp where
        it has a `context` dimension: of dp and cp, one left at 0 takes what the other leaves;
        both at 0, every rank shares each sequence)."""
        p, world = cfg.parallel, cfg.world_size
        if p.tp < 1 or p.pp < 1 or p.dp < 0 or p.cp < 0:
            raise ConfigError(
                f"parallel.tp and parallel.pp must be at least 1, parallel.dp and parallel.cp at least 0 "
                f"(auto); got dp={p.dp}, tp={p.tp}, pp={p.pp}, cp={p.cp}."
            )
        cp = (p.cp or (world // (p.dp * p.tp * p.pp) if p.dp else world // (p.tp * p.pp))) if context else 1
        rest = p.tp * p.pp * max(cp, 1)
        dp = p.dp or (world // rest if world % rest == 0 else 0)
        if dp == 0 or cp == 0:
            raise ConfigError(
                f"parallel.tp x parallel.pp{' x parallel.cp' if context else ''} = {p.tp} x {p.pp}"
                f"{f' x {cp}' if context else ''} does not divide the {world} processes; pick degrees whose "
                "product divides --nproc x --nnodes."
            )
        return cls(dp=dp, tp=p.tp, pp=p.pp, world_size=world, cp=cp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension (row-major over pp, dp, cp, tp)."""
        return {
            "pp": rank // (self.dp * self.cp * self.tp),
            "dp": rank // (self.cp * self.tp) % self.dp,
            "cp": rank // self.tp % self.cp,
            "tp": rank % self.tp,
        }

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """One DeviceMesh over every rank: ("dp", "tp") without a pipeline, ("pp", "dp") with one
        and tp = 1, all three otherwise; ("dp", "cp") for context parallelism."""
        keep = {
            "pp": self.pp > 1,
            "dp": True,
            "cp": self.cp > 1,
            "tp": self.tp > 1 or (self.pp == 1 and self.cp == 1),
        }
        dims = [
            (n, d) for n, d in (("pp", self.pp), ("dp", self.dp), ("cp", self.cp), ("tp", self.tp)) if keep[n]
        ]
        return init_device_mesh(
            device_type, tuple(d for _, d in dims), mesh_dim_names=tuple(n for n, _ in dims)
        )


class MeshStrategy:
    """Mixin for a strategy on a multi-dimensional mesh: the data-parallel degree and this rank's
    data-parallel index come from `ParallelDims`, not from the world size. List it before the
    strategy class it extends."""

    @classmethod
    def data_parallel_size(cls, cfg: Config) -> int:
        return ParallelDims.of(cls.dims, cfg).dp  # type: ignore[attr-defined]

    def __init__(self, cfg: Config, env) -> None:
        super().__init__(cfg, env)  # type: ignore[call-arg]
        self.dims = ParallelDims.of(type(self).dims, cfg)  # type: ignore[attr-defined]
        self.dp_rank = self.dims.coordinates(env.rank)["dp"]
