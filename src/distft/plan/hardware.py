"""Hardware profiles, links, and the time a collective takes on them.

`GPUS` (from `distft.measure.gpus`, where training's MFU reads it too) holds per-GPU memory and
dense bf16 tensor-core throughput; `LINKS` (there too) the bandwidth of each interconnect, per direction.
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

from distft.errors import ConfigError
from distft.measure.comm import WIRE_FACTOR
from distft.measure.gpus import GPU, GPUS, LINKS, GiB, Link


def generic_gpu(memory: int) -> GPU:
    """A GPU known only by its memory (no throughput figure: compute time is not estimated)."""
    return GPU("custom", f"custom GPU {format_bytes(memory)}", memory, None, "pcie4", None, vendor=False)


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


# ---- Collectives --------------------------------------------------------------------------------


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
    steps = 1 if kind in ("send", "recv") else (n - 1) * (2 if kind == "all_reduce" else 1)  # ring steps
    return wire_bytes(kind, nbytes, n) / rate + calls * steps * link.latency_s


# ---- Sizes --------------------------------------------------------------------------------------

# A size's units: kB, MB, GB, TB decimal; KiB, MiB, GiB, TiB and a bare k, M, G, T binary.
_UNITS = {"b": 1} | {
    prefix + suffix: (1000 if suffix == "b" else 1024) ** power
    for power, prefix in enumerate("kmgt", start=1)
    for suffix in ("", "b", "ib")
}


def parse_bytes(text: str) -> int:
    """'24GiB', '80GB', '24 G', '49152MiB' -> bytes. GB is decimal, GiB (and a bare G) binary."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
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
