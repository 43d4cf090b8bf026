"""Hardware profiles, links, and the time a collective takes on them.

`GPUS` (from `distft.measure.gpus`, where training's MFU reads it too) holds per-GPU memory and
dense bf16 tensor-core throughput; `LINKS` the bandwidth of each
interconnect, per direction. Figures marked `vendor=True` are datasheet numbers (peaks; training
reaches a fraction of them); `efficiency` and `latency_s` are our assumptions, stated once here:
NCCL's ring collectives typically reach 70-85% of a link's per-direction bandwidth, less through
host memory (consumer GPUs without peer-to-peer, such as the RTX 4090).

Ring collectives over N ranks move, per rank, for a logical tensor of B bytes (`distft.measure.comm`'s
convention: all-reduce the reduced tensor, all-gather the gathered output, reduce-scatter the
full input):
- all-reduce: 2 (N-1)/N x B (a reduce-scatter followed by an all-gather);
- all-gather, reduce-scatter, all-to-all: (N-1)/N x B;
- send / recv / broadcast: B.
Time = bytes on the wire / (bandwidth x efficiency) + latency x ring steps (2 (N-1) for an
all-reduce, N-1 for the others, 1 for point to point). `comm_time` is the function `bench`'s
projection mode reuses.

A collective is as fast as the slowest link it crosses. Within a node GPUs talk over PCIe or
NVLink; across nodes over InfiniBand, assumed one NIC per GPU (as in DGX/HGX systems), so a
group spanning nodes runs at the NIC's rate per GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from distft.errors import ConfigError
from distft.measure.comm import WIRE_FACTOR
from distft.measure.gpus import GPU, GPU_ALIASES, GPUS, GiB

GB = 1000**3


@dataclass(frozen=True)
class Link:
    name: str
    label: str
    bandwidth: float  # bytes/s per direction (vendor figure)
    efficiency: float  # fraction of `bandwidth` a ring collective reaches (assumption)
    latency_s: float  # per ring step (assumption)
    inter_node: bool = False

    VENDOR_FIELDS = ("bandwidth",)
    ASSUMED_FIELDS = ("efficiency", "latency_s")

    @property
    def effective(self) -> float:
        return self.bandwidth * self.efficiency


LINKS: dict[str, Link] = {
    # PCIe x16: 16 GT/s x 16 lanes (gen4) ~ 32 GB/s per direction; gen5 doubles it. Consumer cards
    # without peer-to-peer go through host memory, hence the lower efficiency assumed.
    "pcie4": Link("pcie4", "PCIe 4.0 x16", 32 * GB, 0.7, 15e-6),
    "pcie5": Link("pcie5", "PCIe 5.0 x16", 64 * GB, 0.7, 15e-6),
    # NVLink: A100 (NVLink 3) 600 GB/s, H100/H200 (NVLink 4) 900 GB/s, both directions summed.
    "nvlink3": Link("nvlink3", "NVLink 3 (A100)", 300 * GB, 0.8, 5e-6),
    "nvlink4": Link("nvlink4", "NVLink 4 (H100/H200)", 450 * GB, 0.8, 5e-6),
    # RTX 3090 NVLink bridge: 112.5 GB/s, both directions.
    "nvlink-bridge": Link("nvlink-bridge", "NVLink bridge (RTX 3090)", 56.25 * GB, 0.8, 5e-6),
    # InfiniBand HDR 200 Gb/s and NDR 400 Gb/s per port, one port (NIC) per GPU assumed.
    "ib-hdr": Link("ib-hdr", "InfiniBand HDR 200 Gb/s", 25 * GB, 0.8, 10e-6, True),
    "ib-ndr": Link("ib-ndr", "InfiniBand NDR 400 Gb/s", 50 * GB, 0.8, 10e-6, True),
}


INTERCONNECTS = ("pcie", "nvlink", "infiniband", *LINKS)


def generic_gpu(memory: int) -> GPU:
    """A GPU known only by its memory (no throughput figure: compute time is not estimated)."""
    return GPU("custom", f"custom GPU {format_bytes(memory)}", memory, None, "pcie4", None, vendor=False)


def find_gpu(name: str) -> GPU:
    key = GPU_ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        raise ConfigError(f"Unknown --gpu {name!r}; known profiles: {', '.join(GPUS)}.")
    return GPUS[key]


def match_gpu(memory: int, interconnect: str | None) -> GPU | None:
    """The profile with this memory, within 3% (and, if several, this kind of link), or None."""
    same = [g for g in GPUS.values() if abs(g.memory - memory) <= 0.03 * g.memory]
    if interconnect in ("nvlink", "nvlink3", "nvlink4"):
        same = [g for g in same if g.nvlink and g.nvlink.startswith("nvlink")] or same
    elif interconnect and interconnect.startswith("pcie"):
        same = [g for g in same if g.nvlink is None] or same
    return same[0] if same else None


def intra_node_link(gpu: GPU, interconnect: str | None) -> Link:
    """The link between GPUs of one node: named explicitly, or the GPU's usual one."""
    if interconnect in LINKS and not LINKS[interconnect].inter_node:
        return LINKS[interconnect]
    if interconnect == "pcie":
        return LINKS[gpu.pcie]
    if interconnect == "nvlink":
        if gpu.nvlink is None:
            raise ConfigError(f"--interconnect nvlink: {gpu.label} has no NVLink; use pcie.")
        return LINKS[gpu.nvlink]
    return LINKS[gpu.nvlink or gpu.pcie]  # infiniband or unset: the node's own fabric


def inter_node_link(interconnect: str | None) -> Link:
    if interconnect in LINKS and LINKS[interconnect].inter_node:
        return LINKS[interconnect]
    return LINKS["ib-ndr"]


# ---------------------------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------------------------

RING_STEPS = {
    "all_reduce": lambda n: 2 * (n - 1),
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: n - 1,
    "all_to_all": lambda n: n - 1,
    "broadcast": lambda n: n - 1,
    "send": lambda n: 1,
    "recv": lambda n: 1,
}


def wire_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends for a collective of logical size `nbytes` over `n` ranks (ring)."""
    if n <= 1 and kind not in ("send", "recv"):
        return 0.0
    return WIRE_FACTOR[kind](n) * nbytes


def comm_time(kind: str, nbytes: float, n: int, link: Link, calls: int = 1) -> float:
    """Seconds for `calls` collectives of `kind` moving `nbytes` (logical, in total) over `n` ranks."""
    if n <= 1 and kind not in ("send", "recv"):
        return 0.0
    return wire_bytes(kind, nbytes, n) / link.effective + calls * RING_STEPS[kind](n) * link.latency_s


# ---------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------

_UNITS = {
    "": None,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": GiB,
    "gb": GB,
    "gib": GiB,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_bytes(text: str) -> int:
    """'24GiB', '80GB', '24 G', '49152MiB' -> bytes. GB is decimal, GiB (and a bare G) binary."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS or _UNITS[unit] is None or float(m.group(1)) <= 0:
        raise ConfigError(
            f"--gpu-mem {text!r} is not a memory size. Give a positive number with a unit: 24GiB, 80GB, "
            "141GB, 49152MiB (GB and MB are decimal, GiB, MiB and a bare G binary)."
        )
    return int(float(m.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """Binary units, three significant figures: 23.5 GiB, 512 MiB, 0 B."""
    for unit, size in (("TiB", 1024**4), ("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{n:.0f} B"


def format_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us" if s > 0 else "0"
