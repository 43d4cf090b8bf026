"""How the ranks of a run are laid out: a degree along each of six mesh dimensions.

A run's world is the product of five dimensions, laid out row-major, outermost first:
- `pp`: pipeline stages (consecutive decoder layers on each); a boundary sends one activation per
  micro-batch, the cheapest traffic, so it may cross nodes;
- `dp_replicate`: data-parallel replicas, ranks holding the same weights (DDP, ZeRO-1, HSDP's
  replicas across nodes): their gradients are all-reduced once per step;
- `dp_shard`: data-parallel ranks that split every parameter, gradient and optimizer state
  between them (FSDP2, HSDP's shard group inside a node);
- `cp`: ranks sharing each sequence, 1/cp of its positions each;
- `tp`: ranks sharing each layer's weights, exchanging activations every layer: the innermost,
  so a TP group is neighbouring ranks (one node, NVLink), as in torchtitan and Megatron-LM.
The sixth, `ep`, splits no further: it groups ep consecutive ranks of `dp_shard` that hold 1/ep of
a mixture of experts' experts each and exchange tokens by all-to-all (fsdp+ep's expert group).

With dp_shard=2 x tp=2, ranks {0, 1} and {2, 3} are TP groups, {0, 2} and {1, 3} FSDP groups;
with pp=2 x dp_shard=2, {0, 2} and {1, 3} are the pipelines. `dp` (dp_replicate x dp_shard) is
the number of ranks reading distinct rows, the split of the global batch.

`ParallelDims.of(spec, cfg)` reads the degrees a strategy runs a config with (parallel.dp / tp /
pp / cp where the strategy takes them, parallel.shard, parallel.ep); `to_overrides` writes them
back as the settings that give them. Validation runs when a `ParallelDims` is built, so one that
exists is consistent; the runtime's mesh (`distft.parallel.mesh`), the planner, bench and the
CLI's checks all read the same one. Torch-free: the CLI checks a layout before importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from distft.config import Config
from distft.errors import ConfigError
from distft.layout.spec import DIMS, WORLD_DIMS, StrategySpec


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in DIMS:
            if getattr(self, name) < 1:
                raise ConfigError(f"the {name} degree must be at least 1, got {getattr(self, name)}.")
        if self.dp_shard % self.ep:
            raise ConfigError(
                f"an expert group of {self.ep} ranks must divide the {self.dp_shard} ranks sharding "
                "the data into equal groups."
            )

    @property
    def world_size(self) -> int:
        return prod(getattr(self, d) for d in WORLD_DIMS)

    @property
    def dp(self) -> int:
        """Ranks reading distinct rows: the global batch is split this many ways."""
        return self.dp_replicate * self.dp_shard

    def degrees(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in DIMS}

    # -- from and to a config ---------------------------------------------------------------------
    @classmethod
    def of(cls, spec: StrategySpec, cfg: Config) -> ParallelDims:
        """The degrees `spec`'s strategy runs `cfg` with: the user's parallel.dp / tp / pp / cp where
        it takes several of them (`spec.sized`), every rank along its one dimension otherwise; the
        data-parallel ranks split into shard groups by parallel.shard (HSDP: a node's by default), and
        expert groups of parallel.ep (fsdp+ep: every rank by default)."""
        world = cfg.world_size if spec.distributed else 1
        if spec.sized:
            dp, tp, pp, cp = _sized(cfg, context="cp" in spec.dims)
        else:
            axes = {"dp": 1, "tp": 1, "pp": 1, "cp": 1} | {a: world for a in spec.axes}
            dp, tp, pp, cp = axes["dp"], axes["tp"], axes["pp"], axes["cp"]
        p = cfg.parallel
        shard = p.shard or node_shard(p.nproc, dp, tp, cp)
        return cls.split(spec, dp, tp=tp, pp=pp, cp=cp, shard=shard, ep=p.ep)

    @classmethod
    def split(
        cls, spec: StrategySpec, dp: int, tp: int = 1, pp: int = 1, cp: int = 1, shard: int = 0, ep: int = 0
    ) -> ParallelDims:
        """The degrees of `spec`'s strategy with `dp` data-parallel ranks: replicas or shards as it
        holds them, in shard groups of `shard` where it has both (HSDP), in expert groups of `ep`
        where it has them (0: every rank sharding the data). The runtime (`of`) and the planner's
        candidates build their degrees here."""
        replicate, sharding = (1, dp) if "dp_shard" in spec.dims else (dp, 1)
        if spec.shard_groups:
            if shard < 1 or dp % shard:
                ranks = "processes (--nproc x --nnodes)" if tp * pp * cp == 1 else "data-parallel ranks"
                raise ConfigError(
                    f"parallel.shard={shard} must divide the {dp} {ranks} into equal shard groups; e.g. "
                    "parallel.shard=--nproc, one group per node."
                )
            replicate, sharding = dp // shard, shard
        groups = (ep or sharding) if spec.expert_groups else 1
        if groups < 1 or sharding % groups:
            raise ConfigError(
                f"parallel.ep={groups} must divide the {sharding} processes (--nproc x --nnodes) into equal "
                "expert groups; e.g. parallel.ep=--nproc, one group per node."
            )
        return cls(dp_replicate=replicate, dp_shard=sharding, cp=cp, tp=tp, pp=pp, ep=groups)

    def to_overrides(self, spec: StrategySpec) -> dict[str, str]:
        """The `parallel.*` settings that give these degrees under `spec`'s strategy (the plan's
        `run:` line and `--strategy auto` both write them): the mesh of a strategy the user sizes,
        HSDP's shard group, fsdp+ep's expert group where smaller than every rank."""
        out = {}
        if spec.sized:
            out |= {"parallel.dp": str(self.dp), "parallel.tp": str(self.tp), "parallel.pp": str(self.pp)}
            if "cp" in spec.dims:
                out["parallel.cp"] = str(self.cp)
        if spec.shard_groups:
            out["parallel.shard"] = str(self.dp_shard)
        if "ep" in spec.dims and self.ep < self.dp_shard:
            out["parallel.ep"] = str(self.ep)
        return out

    # -- ranks ------------------------------------------------------------------------------------
    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each world dimension, and along `dp` (replicate x shard) and
        `ep` (its place in its expert group)."""
        coords, rest = {}, rank
        for d in reversed(WORLD_DIMS):
            coords[d] = rest % getattr(self, d)
            rest //= getattr(self, d)
        coords["dp"] = coords["dp_replicate"] * self.dp_shard + coords["dp_shard"]
        coords["ep"] = coords["dp_shard"] % self.ep
        return {d: coords[d] for d in (*WORLD_DIMS, "dp", "ep")}

    def group(self, dim: str, rank: int) -> list[int]:
        """The global ranks of `rank`'s group along `dim` (a world dimension, `dp`, or `ep`): those
        whose every other coordinate equals this rank's, in order."""
        mine = self.coordinates(rank)
        varies = {"dp": {"dp_replicate", "dp_shard"}, "ep": {"dp_shard"}}.get(dim, {dim})
        same = [d for d in WORLD_DIMS if d not in varies]
        members = []
        for other in range(self.world_size):
            theirs = self.coordinates(other)
            same_group = dim != "ep" or theirs["dp_shard"] // self.ep == mine["dp_shard"] // self.ep
            if same_group and all(theirs[d] == mine[d] for d in same):
                members.append(other)
        return members


def node_shard(gpus_per_node: int, dp: int, tp: int = 1, cp: int = 1) -> int:
    """A node's data-parallel ranks, at most all of them: HSDP's (and HSDP x TP's) shard group when
    parallel.shard leaves it to the layout; the runtime and the planner both take it from here."""
    return max(1, min(gpus_per_node // (tp * cp), dp))


def _sized(cfg: Config, context: bool) -> tuple[int, int, int, int]:
    """(dp, tp, pp, cp) of a strategy the user sizes: parallel.dp / tp / pp, and cp where it has a
    context dimension (of dp and cp, one left at 0 takes what the other leaves; both at 0, every
    rank shares each sequence)."""
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
    if dp * rest != world:
        cp_name, cp_value = (" x parallel.cp", f" x {cp}") if context else ("", "")
        raise ConfigError(
            f"parallel.dp x parallel.tp x parallel.pp{cp_name} = {dp} x {p.tp} x {p.pp}{cp_value} = "
            f"{dp * rest}, but the run has {world} processes (--nproc x --nnodes). The degrees must "
            "multiply to the world size; parallel.dp=0 takes what is left."
        )
    return dp, p.tp, p.pp, cp
