"""The one mesh builder (`distft.parallel.dims.build_mesh`): for every strategy of several ranks,
its mesh's groups, flattened ones too, are the layout's (`ParallelDims.group`), in one 4-rank gloo
group: the runtime's process groups and the planner's and ranks.json's description of them agree."""

from __future__ import annotations

from distft.config import load_config
from distft.layout import SPECS, ParallelDims
from distft.parallel.dims import build_mesh, mesh_groups
from tests.parallel.test_collectives import run_group
from tests.parallel.test_registry import layout_overrides

WORLD = 4


def layout_dim(name: str, spec) -> str:
    """The layout's dimension a mesh dimension is named for (`build_mesh`)."""
    if name == "replicate":
        return "dp_replicate" if spec.shard_groups else "replicate"
    return {"shard": "dp_shard", "dp_cp": "dp"}.get(name, name)


def _check_meshes(rank: int, world: int) -> None:
    for name, spec in SPECS.items():
        if not spec.distributed:
            continue
        dims = ParallelDims.of(spec, load_config(None, layout_overrides(name, world)))
        mesh, flattened = build_mesh(spec, dims, "cpu")
        groups = mesh_groups(mesh, flattened)
        assert mesh.size() == world, name
        for dim, ranks in groups.items():
            if layout_dim(dim, spec) == "replicate":  # fsdp+ep: the ranks holding the same experts
                want = [r for r in range(world) if r % dims.ep == rank % dims.ep]
            elif dim == "dp_cp":  # FSDP over the data and context-parallel ranks: those of its pp and tp
                mine = dims.coordinates(rank)
                want = [
                    r for r in range(world) if all(dims.coordinates(r)[d] == mine[d] for d in ("pp", "tp"))
                ]
            else:
                want = dims.group(layout_dim(dim, spec), rank)
            assert ranks == want, (name, dim, ranks, want)
        expected = {"hsdp": {"replicate", "shard", "dp"}, "fsdp+cp": {"dp", "cp", "dp_cp"}}
        expected |= {
            "fsdp+ep": {"replicate", "ep", "dp"},
            "fsdp+tp": {"dp", "tp"},
            "fsdp+tp+pp": {"pp", "dp", "tp"},
        }
        assert set(groups) == expected.get(name, set(groups)), (name, set(groups))


def test_every_strategy_mesh_has_the_layout_groups():
    run_group(_check_meshes, world=WORLD)
