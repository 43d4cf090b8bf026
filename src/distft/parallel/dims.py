"""The device mesh of a multi-dimensional run, from its `distft.layout.ParallelDims`.

The degrees, their validation and the rank order (row-major over pp, dp, cp, tp: tp the innermost,
so a TP group is neighbouring ranks, one node; pp the outermost, a stage boundary may cross nodes)
are the layout's; here they become one `DeviceMesh` over every rank.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from distft.layout import ParallelDims


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """One DeviceMesh over every rank: ("dp", "tp") without a pipeline, ("pp", "dp") with one
    and tp = 1, all three otherwise; ("dp", "cp") for context parallelism."""
    keep = {
        "pp": dims.pp > 1,
        "dp": True,
        "cp": dims.cp > 1,
        "tp": dims.tp > 1 or (dims.pp == 1 and dims.cp == 1),
    }
    sizes = (("pp", dims.pp), ("dp", dims.dp), ("cp", dims.cp), ("tp", dims.tp))
    kept = [(name, size) for name, size in sizes if keep[name]]
    return init_device_mesh(
        device_type, tuple(size for _, size in kept), mesh_dim_names=tuple(name for name, _ in kept)
    )
