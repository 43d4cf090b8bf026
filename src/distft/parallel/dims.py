"""The device mesh of a run, from its `distft.layout.ParallelDims`: the only `init_device_mesh`.

The degrees, their validation and the rank order (row-major over pp, dp_replicate, dp_shard, cp,
tp: tp the innermost, so a TP group is neighbouring ranks, one node; pp the outermost, a stage
boundary may cross nodes) are the layout's; here they become one `DeviceMesh` over every rank,
with the dimensions the strategy spans, named as the collectives are counted (`measure/comm.py`
credits each to its group's name):
- "pp", "cp", "tp": those dimensions;
- "dp": the data-parallel ranks, where they are all replicas or all shards;
- "replicate" x "shard": HSDP's replicas of its shard groups (FSDP2 takes the 2D sub-mesh as is);
- "replicate" x "ep": fsdp+ep's expert groups where smaller than every rank.
What a strategy reduces over as one is a flattened sub-mesh of those, kept beside the mesh (torch
deprecates slicing them from it): "dp" over "replicate" x "shard" (or x "ep"), "dp_cp" over "dp" x
"cp" (FSDP shards over the context-parallel ranks too).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from distft.layout import WORLD_DIMS, ParallelDims, StrategySpec

FLATTENED = {"dp": (("replicate", "shard"), ("replicate", "ep")), "dp_cp": (("dp", "cp"),)}


def build_mesh(
    spec: StrategySpec, dims: ParallelDims, device_type: str
) -> tuple[DeviceMesh, dict[str, DeviceMesh]]:
    """One DeviceMesh over every rank for `spec`'s strategy at `dims`, and its flattened sub-meshes
    by name."""
    named: list[tuple[str, int]] = []
    for dim in (d for d in WORLD_DIMS if d in spec.dims):
        size = dims.degrees()[dim]
        if dim == "dp_replicate":
            named.append(("replicate" if spec.shard_groups else "dp", size))
        elif dim == "dp_shard" and spec.shard_groups:
            named.append(("shard", size))
        elif dim == "dp_shard" and spec.expert_groups and dims.ep < size:
            named += [("replicate", size // dims.ep), ("ep", dims.ep)]
        else:
            named.append(("dp" if dim == "dp_shard" else dim, size))
    names = tuple(name for name, _ in named)
    mesh = init_device_mesh(device_type, tuple(size for _, size in named), mesh_dim_names=names)
    flattened = {
        flat: mesh[source]._flatten(flat)
        for flat, sources in FLATTENED.items()
        for source in sources
        if set(source) <= set(names)
    }
    return mesh, flattened


def mesh_groups(mesh: DeviceMesh, flattened: dict[str, DeviceMesh]) -> dict[str, list[int]]:
    """The global ranks of this rank's group along each dimension of `mesh` and each flattened one."""
    meshes = {name: mesh[name] for name in mesh.mesh_dim_names or ()} | flattened
    return {name: dist.get_process_group_ranks(m.get_group()) for name, m in meshes.items()}
