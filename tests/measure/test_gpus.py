"""The GPU table: every row's device name (as torch reports it) finds that row and no other."""

import pytest

from distft.measure.gpus import GPUS, GiB, gpu_for_device_name


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA GH200 480GB", "gh200"),  # 480 GB is the Grace CPU's memory: the 96 GB GPU
        ("NVIDIA GH200 144G HBM3e", "gh200-144gb"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA B200", "b200"),
        ("AMD Instinct MI300X", "mi300x"),  # ROCm's torch.cuda.get_device_name
        ("NVIDIA L4", "l4"),
        ("NVIDIA L40S", "l40s"),  # not the L4: names match as whole words
        ("NVIDIA GeForce RTX 5090", "rtx5090"),
    ],
)
def test_device_names_find_their_row(name, key):
    assert gpu_for_device_name(name).name == key


def test_unknown_devices_find_none():
    assert gpu_for_device_name("Tesla T4") is None
    assert gpu_for_device_name("AMD Instinct MI250X") is None


def test_new_rows_carry_datasheet_figures():
    """Memory and dense bf16 peaks as the comments in distft.measure.gpus cite them."""
    figures = {
        "h100-nvl": (94, 835.5),
        "gh200": (96, 989.0),
        "gh200-144gb": (144, 989.0),
        "b200": (180, 2250.0),
        "mi300x": (192, 1307.4),
        "l4": (24, 121.0),
        "rtx5090": (32, 209.5),
    }
    for key, (gib, tflops) in figures.items():
        assert (GPUS[key].memory, GPUS[key].bf16_tflops) == (gib * GiB, tflops), key
    assert GPUS["mi300x"].nvlink == "infinity-fabric"  # RCCL over Infinity Fabric, no NVLink
    assert GPUS["l4"].nvlink is None and GPUS["rtx5090"].nvlink is None
    assert GPUS["rtx5090"].pcie == "pcie5" and GPUS["l4"].pcie == "pcie4"
