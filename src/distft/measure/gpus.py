"""The GPU table: memory and peak dense bf16 throughput per GPU, and matching a device to a row;
the link table: the bandwidth of each interconnect (`LINKS`, whose assumptions `distft.plan.hardware`
states).

The planner (`distft.plan.hardware`) sizes runs and times steps with it; training divides its
achieved FLOP/s by the peak here to report MFU (`distft.measure.flops`). `bf16_tflops` is the
vendor's dense bf16 tensor-core figure (no 2:4 sparsity: a datasheet's "with sparsity" figure
halved), the denominator MFU is conventionally quoted against. Where a datasheet gives only the
sparse figure, the comment says so. GeForce cards are quoted with fp32 accumulation (what bf16
training uses), half their fp16-accumulate rate.

`memory` is the capacity as the vendor states it, taken in binary units: an "80 GB" HBM card
shows 80 GiB (nvidia-smi: 81,559 MiB), and the other rows follow the same convention.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from distft.errors import ConfigError

GiB = 1024**3


@dataclass(frozen=True)
class GPU:
    name: str
    label: str
    memory: int  # bytes (vendor figure)
    bf16_tflops: float | None  # dense bf16 tensor-core peak, TFLOP/s (vendor figure)
    pcie: str  # the host link (a `distft.plan.hardware.LINKS` key): PCIe, or GH200's NVLink-C2C
    nvlink: str | None  # the GPU-to-GPU link of the usual multi-GPU system (NVLink, Infinity Fabric), if any
    vendor: bool = True  # memory and bf16_tflops are datasheet figures (False: user-given memory only)

    VENDOR_FIELDS = ("memory", "bf16_tflops")


GPUS: dict[str, GPU] = {
    # Ada whitepaper: 165.2 TFLOP/s bf16 with fp32 accumulate (dense); no NVLink, no P2P on GeForce.
    "rtx4090": GPU("rtx4090", "RTX 4090 24 GB", 24 * GiB, 165.2, "pcie4", None),
    "rtx3090": GPU("rtx3090", "RTX 3090 24 GB", 24 * GiB, 71.0, "pcie4", "nvlink-bridge"),
    "l40s": GPU("l40s", "L40S 48 GB", 48 * GiB, 362.0, "pcie4", None),
    "a100-40gb": GPU("a100-40gb", "A100 SXM 40 GB", 40 * GiB, 312.0, "pcie4", "nvlink3"),
    "a100-80gb": GPU("a100-80gb", "A100 SXM 80 GB", 80 * GiB, 312.0, "pcie4", "nvlink3"),
    "h100": GPU("h100", "H100 SXM 80 GB", 80 * GiB, 989.0, "pcie5", "nvlink4"),
    "h100-pcie": GPU("h100-pcie", "H100 PCIe 80 GB", 80 * GiB, 756.0, "pcie5", None),
    "h200": GPU("h200", "H200 SXM 141 GB", 141 * GiB, 989.0, "pcie5", "nvlink4"),
    # H100 datasheet (H100 NVL column): 94 GB HBM3, bf16 1,671 TFLOP/s with sparsity (835.5 dense),
    # PCIe 5.0 x16 to the host, an NVLink bridge of 600 GB/s (both directions) joining two cards.
    "h100-nvl": GPU("h100-nvl", "H100 NVL 94 GB", 94 * GiB, 835.5, "pcie5", "nvlink-bridge-nvl"),
    # GH200 Grace Hopper Superchip datasheet: an H100 GPU (bf16 1,979 TFLOP/s with sparsity, 989
    # dense) joined to a Grace CPU by NVLink-C2C (900 GB/s, both directions, CPU-GPU only); GPUs of
    # different superchips talk over NVLink 4 (NVL2 / NVL32 and quad-GH200 nodes) or the network.
    # Two memory variants: "gh200" is the 96 GB HBM3 one the clouds rent; gh200-144gb the HBM3e one.
    "gh200": GPU("gh200", "GH200 96 GB HBM3", 96 * GiB, 989.0, "nvlink-c2c", "nvlink4"),
    "gh200-144gb": GPU("gh200-144gb", "GH200 144 GB HBM3e", 144 * GiB, 989.0, "nvlink-c2c", "nvlink4"),
    # HGX B200 / DGX B200 datasheets: 180 GB HBM3e per GPU (1,440 GB for 8; 192 GB is the package's
    # headline), bf16 4.5 PFLOP/s with sparsity (2,250 dense), NVLink 5 at 1.8 TB/s (both directions).
    # The host link of those systems is taken as PCIe 5.0 (an assumption: the planner rarely uses it).
    "b200": GPU("b200", "B200 180 GB", 180 * GiB, 2250.0, "pcie5", "nvlink5"),
    # AMD Instinct MI300X datasheet: 192 GB HBM3, bf16 1,307.4 TFLOP/s dense (2,614.9 with
    # sparsity), PCIe 5.0 x16 to the host, 7 Infinity Fabric links to the other 7 GPUs of an 8-GPU
    # platform. Collectives run on RCCL (ROCm's NCCL), over Infinity Fabric: no NVLink.
    "mi300x": GPU("mi300x", "MI300X 192 GB", 192 * GiB, 1307.4, "pcie5", "infinity-fabric"),
    # L4 datasheet: 24 GB GDDR6, bf16 242 TFLOP/s with sparsity (121 dense), PCIe 4.0 x16 only.
    "l4": GPU("l4", "L4 24 GB", 24 * GiB, 121.0, "pcie4", None),
    # RTX Blackwell whitepaper's headline for the RTX 5090: 32 GB GDDR7, fp16/bf16 tensor 209.5
    # TFLOP/s dense with fp32 accumulate (419 with fp16 accumulate; the figure as summaries of the
    # whitepaper quote it, not checked against the whitepaper itself), PCIe 5.0 x16, no NVLink.
    "rtx5090": GPU("rtx5090", "RTX 5090 32 GB", 32 * GiB, 209.5, "pcie5", None),
}
GPU_ALIASES = {
    "4090": "rtx4090",
    "3090": "rtx3090",
    "5090": "rtx5090",
    "a100": "a100-80gb",
    "h100-sxm": "h100",
    "a100-40": "a100-40gb",
    "h100nvl": "h100-nvl",
    "gh200-96gb": "gh200",
    "gh200-hbm3": "gh200",
    "gh200-hbm3e": "gh200-144gb",
    "mi300": "mi300x",
}


# `torch.cuda.get_device_name` spellings (ROCm's torch answers through the same call), matched as
# whole words, most specific first: "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL",
# "NVIDIA GH200 480GB" (480 GB is the CPU's memory: the 96 GB GPU), "NVIDIA GH200 144G HBM3e",
# "NVIDIA B200", "AMD Instinct MI300X", "NVIDIA A100-SXM4-40GB", "NVIDIA GeForce RTX 5090",
# "NVIDIA L40S", "NVIDIA L4" ...
_DEVICE_NAMES = (
    ("h100 pcie", "h100-pcie"),
    ("h100 nvl", "h100-nvl"),
    ("h100", "h100"),
    ("gh200 144g", "gh200-144gb"),
    ("gh200", "gh200"),
    ("h200", "h200"),
    ("b200", "b200"),
    ("mi300x", "mi300x"),
    ("a100-sxm4-40gb", "a100-40gb"),
    ("a100-pcie-40gb", "a100-40gb"),
    ("a100", "a100-80gb"),
    ("l40s", "l40s"),
    ("l4", "l4"),
    ("rtx 5090", "rtx5090"),
    ("rtx 4090", "rtx4090"),
    ("rtx 3090", "rtx3090"),
)


def gpu_for_device_name(device_name: str) -> GPU | None:
    """The table's row for a device name (`torch.cuda.get_device_name`), or None. Whole words only:
    "l4" is not in "L40S", nor "h200" in "GH200"."""
    name = device_name.lower()
    return next(
        (GPUS[key] for part, key in _DEVICE_NAMES if re.search(rf"\b{re.escape(part)}\b", name)), None
    )


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
    # CPU processes of one host, gloo over loopback TCP (measured on the 2-core test machine: a 64 MiB
    # all-reduce between 2 processes at 1.2 GB/s of bus bandwidth, a 4-byte one in ~0.4 ms).
    "gloo-host": Link("gloo-host", "gloo between the processes of one host", 1.2 * GB, 1.0, 200e-6),
    # InfiniBand HDR 200 Gb/s and NDR 400 Gb/s per port, one port (NIC) per GPU assumed.
    "ib-hdr": Link("ib-hdr", "InfiniBand HDR 200 Gb/s", 25 * GB, 0.8, 10e-6, True),
    "ib-ndr": Link("ib-ndr", "InfiniBand NDR 400 Gb/s", 50 * GB, 0.8, 10e-6, True),
}


INTERCONNECTS = ("pcie", "nvlink", "infiniband", *(k for k, link in LINKS.items() if not link.host))


def find_gpu(name: str) -> GPU:
    """A profile by key, alias, or the name torch gives the device ("NVIDIA H100 NVL")."""
    key = GPU_ALIASES.get(name.lower(), name.lower())
    gpu = GPUS.get(key) or gpu_for_device_name(name)
    if gpu is None:
        raise ConfigError(f"Unknown --gpu {name!r}; known profiles: {', '.join(GPUS)}.")
    return gpu
