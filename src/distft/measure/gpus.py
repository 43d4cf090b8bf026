"""The GPU table: memory and peak dense bf16 throughput per GPU, and matching a device to a row.

The planner (`distft.plan.hardware`) sizes runs with it; training divides its achieved FLOP/s by
the peak here to report MFU (`distft.measure.flops`). `bf16_tflops` is the vendor's dense bf16
tensor-core figure (no 2:4 sparsity), the denominator MFU is conventionally quoted against.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class GPU:
    name: str
    label: str
    memory: int  # bytes (vendor figure)
    bf16_tflops: float | None  # dense bf16 tensor-core peak, TFLOP/s (vendor figure)
    pcie: str  # the host link
    nvlink: str | None  # the GPU-to-GPU link of the usual multi-GPU system, if any
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
    # HBM capacities are binary in practice: an "80 GB" card has 80 GiB (nvidia-smi: 81,559 MiB usable).
    "h200": GPU("h200", "H200 SXM 141 GB", 141 * GiB, 989.0, "pcie5", "nvlink4"),
}
GPU_ALIASES = {
    "4090": "rtx4090",
    "3090": "rtx3090",
    "a100": "a100-80gb",
    "h100-sxm": "h100",
    "a100-40": "a100-40gb",
}


# `torch.cuda.get_device_name` spellings, most specific first: "NVIDIA H100 80GB HBM3",
# "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-40GB", "NVIDIA GeForce RTX 4090", "NVIDIA L40S", ...
_DEVICE_NAMES = (
    ("h100 pcie", "h100-pcie"),
    ("h100", "h100"),
    ("h200", "h200"),
    ("a100-sxm4-40gb", "a100-40gb"),
    ("a100-pcie-40gb", "a100-40gb"),
    ("a100", "a100-80gb"),
    ("l40s", "l40s"),
    ("rtx 4090", "rtx4090"),
    ("rtx 3090", "rtx3090"),
)


def gpu_for_device_name(device_name: str) -> GPU | None:
    """The table's row for a CUDA device name (`torch.cuda.get_device_name`), or None."""
    name = device_name.lower()
    return next((GPUS[key] for part, key in _DEVICE_NAMES if part in name), None)
