"""Hardware profiles, links, and the time a collective takes on them.

`GPUS` (from `distft.measure.gpus`, where training's MFU reads it too) holds per-GPU memory and
dense bf16 tensor-core throughput; `LINKS` the bandwidth of each interconnect, per direction.
Figures marked `vendor=True` are datasheet numbers (peaks; training reaches a fraction of them);
`efficiency` and `latency_s` are our assumptions, stated once here: NCCL's ring collectives
(RCCL's on AMD GPUs, the same algorithms) typically reach 70-85% of a link's per-direction
bandwidth, less through host memory (consumer GPUs without peer-to-peer, such as the RTX 4090).

Ring collectives over N ranks move, per rank, for a logical tensor of B bytes (`distft.measure.comm`'s
convention: all-reduce the reduced tensor, all-gather the gathered output, reduce-scatter the
full input):
- all-reduce: 2 (N-1)/N x B (a reduce-scatter followed by an all-gather);
- all-gather, reduce-scatter, all-to-all: (N-1)/N x B;
- send / recv / broadcast: B.
Time = bytes on the wire / (bandwidth x efficiency) + latency x ring steps (2 (N-1) for an
all-reduce, N-1 for the others, 1 for point to point). `comm_time` is the function `bench`'s
projection mode reuses.

A collective is as fast as the slowest link it crosses. Within a node GPUs talk over PCIe,
NVLink (through NVSwitch: every group gets the whole bandwidth) or a mesh of direct links (AMD's
Infinity Fabric: a group of n of the 8 GPUs uses n - 1 of each GPU's 7 links, `Link.mesh`); a
bridge joining two cards (`Link.pairs`) serves nodes of two, larger nodes talk over PCIe. Across
nodes over InfiniBand, assumed one NIC per GPU (as in DGX/HGX systems), so a group spanning
nodes runs at the NIC's rate per GPU. A CPU-GPU link (GH200's NVLink-C2C, `Link.host`) carries
no collective.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from distft.errors import ConfigError
from distft.measure.comm import WIRE_FACTOR
from distft.measure.gpus import GPU, GPU_ALIASES, GPUS, GiB, gpu_for_device_name

GB = 1000**3


@dataclass(frozen=True)
class Link:
    name: str
    label: str
    bandwidth: float  # bytes/s per direction (vendor figure)
    efficiency: float  # fraction of `bandwidth` a ring collective reaches (assumption)
    latency_s: float  # per ring step (assumption)
    inter_node: bool = False
    mesh: int = 0  # direct links per GPU of a fully connected mesh, sharing `bandwidth` (0: a switch)
    pairs: bool = False  # a bridge joining two cards: more GPUs per node talk over the host link
    host: bool = False  # a CPU-GPU link only: no collective runs over it

    VENDOR_FIELDS = ("bandwidth",)
    ASSUMED_FIELDS = ("efficiency", "latency_s")

    @property
    def effective(self) -> float:
        return self.bandwidth * self.efficiency

    def effective_for(self, n: int) -> float:
        """Bytes/s a collective over `n` ranks reaches: on a mesh, n - 1 of the `mesh` links."""
        share = min(max(n - 1, 1), self.mesh) / self.mesh if self.mesh else 1.0
        return self.effective * share


LINKS: dict[str, Link] = {
    # PCIe x16: 16 GT/s x 16 lanes (gen4) ~ 32 GB/s per direction; gen5 doubles it. Consumer cards
    # without peer-to-peer go through host memory, hence the lower efficiency assumed.
    "pcie4": Link("pcie4", "PCIe 4.0 x16", 32 * GB, 0.7, 15e-6),
    "pcie5": Link("pcie5", "PCIe 5.0 x16", 64 * GB, 0.7, 15e-6),
    # NVLink: A100 (NVLink 3) 600 GB/s, H100/H200/GH200 (NVLink 4) 900 GB/s, both directions summed.
    "nvlink3": Link("nvlink3", "NVLink 3 (A100)", 300 * GB, 0.8, 5e-6),
    "nvlink4": Link("nvlink4", "NVLink 4 (H100/H200/GH200)", 450 * GB, 0.8, 5e-6),
    # NVLink 5 (B200): 1.8 TB/s per GPU, both directions summed (HGX B200 datasheet).
    "nvlink5": Link("nvlink5", "NVLink 5 (B200)", 900 * GB, 0.8, 5e-6),
    # RTX 3090 NVLink bridge: 112.5 GB/s, both directions; H100 NVL's: 600 GB/s (H100 datasheet).
    # Each joins two cards.
    "nvlink-bridge": Link("nvlink-bridge", "NVLink bridge (RTX 3090)", 56.25 * GB, 0.8, 5e-6, pairs=True),
    "nvlink-bridge-nvl": Link(
        "nvlink-bridge-nvl", "NVLink bridge (H100 NVL pairs)", 300 * GB, 0.8, 5e-6, pairs=True
    ),
    # AMD Infinity Fabric (MI300X datasheet): 7 links per GPU of 128 GB/s each, both directions
    # (896 GB/s), one to each other GPU of the 8-GPU platform; RCCL's rings use n - 1 of them for
    # n ranks. Efficiency assumed as PCIe's (no better-grounded figure here).
    "infinity-fabric": Link(
        "infinity-fabric", "AMD Infinity Fabric (MI300X, RCCL)", 448 * GB, 0.7, 5e-6, mesh=7
    ),
    # GH200's NVLink-C2C: 900 GB/s CPU-GPU, both directions (GH200 datasheet); not a GPU-GPU link.
    "nvlink-c2c": Link("nvlink-c2c", "NVLink-C2C (GH200, CPU-GPU)", 450 * GB, 0.8, 5e-6, host=True),
    # InfiniBand HDR 200 Gb/s and NDR 400 Gb/s per port, one port (NIC) per GPU assumed.
    "ib-hdr": Link("ib-hdr", "InfiniBand HDR 200 Gb/s", 25 * GB, 0.8, 10e-6, True),
    "ib-ndr": Link("ib-ndr", "InfiniBand NDR 400 Gb/s", 50 * GB, 0.8, 10e-6, True),
}


INTERCONNECTS = ("pcie", "nvlink", "infiniband", *(k for k, link in LINKS.items() if not link.host))


def generic_gpu(memory: int) -> GPU:
    """A GPU known only by its memory (no throughput figure: compute time is not estimated)."""
    return GPU("custom", f"custom GPU {format_bytes(memory)}", memory, None, "pcie4", None, vendor=False)


def find_gpu(name: str) -> GPU:
    """A profile by key, alias, or the name torch gives the device ("NVIDIA H100 NVL")."""
    key = GPU_ALIASES.get(name.lower(), name.lower())
    gpu = GPUS.get(key) or gpu_for_device_name(name)
    if gpu is None:
        raise ConfigError(f"Unknown --gpu {name!r}; known profiles: {', '.join(GPUS)}.")
    return gpu


def match_gpu(memory: int, interconnect: str | None) -> GPU | None:
    """The profile with this memory, within 3% (and, if several, this kind of link), or None."""
    same = [g for g in GPUS.values() if abs(g.memory - memory) <= 0.03 * g.memory]
    if interconnect and interconnect.startswith("nvlink"):
        same = [g for g in same if g.nvlink and g.nvlink.startswith("nvlink")] or same
    elif interconnect and interconnect.startswith("pcie"):
        same = [g for g in same if g.nvlink is None] or same
    return same[0] if same else None


def intra_node_link(gpu: GPU, interconnect: str | None, gpus_per_node: int = 2) -> Link:
    """The link between GPUs of one node: named explicitly, or the GPU's usual one (a two-card
    bridge only for two GPUs a node; PCIe beyond)."""
    if interconnect in LINKS and not LINKS[interconnect].inter_node:
        return LINKS[interconnect]
    host = LINKS[gpu.pcie]
    if host.host and (interconnect == "pcie" or gpu.nvlink is None):
        raise ConfigError(
            f"{gpu.label}'s host link is {host.label}, not a link between GPUs; its GPUs talk over "
            f"{LINKS[gpu.nvlink].label if gpu.nvlink else 'the network'} (--interconnect nvlink or infiniband)."
        )
    if interconnect == "pcie":
        return host
    if interconnect == "nvlink":
        if gpu.nvlink is None or not gpu.nvlink.startswith("nvlink"):
            other = f" (its GPUs talk over {LINKS[gpu.nvlink].label})" if gpu.nvlink else ""
            raise ConfigError(f"--interconnect nvlink: {gpu.label} has no NVLink{other}; use pcie.")
        link = LINKS[gpu.nvlink]
    else:  # infiniband or unset: the node's own fabric
        link = LINKS[gpu.nvlink] if gpu.nvlink else host
    return host if link.pairs and gpus_per_node > 2 else link


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
    rate = link.effective_for(n)
    return wire_bytes(kind, nbytes, n) / rate + calls * RING_STEPS[kind](n) * link.latency_s


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
