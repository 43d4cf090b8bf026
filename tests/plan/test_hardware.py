"""The hardware profiles: every GPU resolves by key, alias and torch's device name; each takes its
own GPU-to-GPU link (NVLink 5, Infinity Fabric, a two-card bridge, PCIe), and the plan's advice
names the link the GPUs have."""

from __future__ import annotations

import pytest

from distft.cli import build_parser, main
from distft.errors import ConfigError
from distft.measure.gpus import GB, find_gpu
from distft.plan import make_request
from distft.plan.hardware import LINKS, comm_time, intra_node_link


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("b200", "b200"),
        ("B200", "b200"),
        ("mi300x", "mi300x"),
        ("mi300", "mi300x"),
        ("AMD Instinct MI300X", "mi300x"),
        ("h100-nvl", "h100-nvl"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("gh200", "gh200"),
        ("gh200-hbm3e", "gh200-144gb"),
        ("l4", "l4"),
        ("NVIDIA L4", "l4"),
        ("5090", "rtx5090"),
        ("NVIDIA GeForce RTX 5090", "rtx5090"),
        ("h100", "h100"),  # the old rows still resolve as before
        ("4090", "rtx4090"),
    ],
)
def test_gpus_resolve_by_key_alias_and_device_name(name, key):
    assert find_gpu(name).name == key


def test_each_gpu_takes_its_own_link():
    assert intra_node_link(find_gpu("b200"), None, 8) is LINKS["nvlink5"]
    assert LINKS["nvlink5"].bandwidth == 900 * GB  # 1.8 TB/s both directions
    assert intra_node_link(find_gpu("gh200"), None, 4) is LINKS["nvlink4"]  # not the CPU's NVLink-C2C
    assert intra_node_link(find_gpu("l4"), None, 8) is LINKS["pcie4"]
    assert intra_node_link(find_gpu("rtx5090"), None, 2) is LINKS["pcie5"]
    # H100 NVL's bridge joins two cards; four talk over PCIe 5.
    assert intra_node_link(find_gpu("h100-nvl"), None, 2) is LINKS["nvlink-bridge-nvl"]
    assert intra_node_link(find_gpu("h100-nvl"), None, 4) is LINKS["pcie5"]


def test_infinity_fabric_is_a_mesh_a_group_uses_part_of():
    """MI300X: 7 direct links per GPU; a collective over n of the 8 GPUs uses n - 1 of them."""
    link = intra_node_link(find_gpu("mi300x"), None, 8)
    assert link is LINKS["infinity-fabric"]
    eight = comm_time("all_gather", 1 * GB, 8, link) - 7 * link.latency_s
    two = comm_time("all_gather", 1 * GB, 2, link) - link.latency_s
    assert eight == pytest.approx(7 / 8 * GB / link.effective)
    assert two == pytest.approx(1 / 2 * GB / (link.effective / 7))


def test_interconnects_that_a_gpu_lacks_are_refused():
    with pytest.raises(ConfigError, match=r"MI300X 192 GB has no NVLink .*Infinity Fabric"):
        intra_node_link(find_gpu("mi300x"), "nvlink", 8)
    with pytest.raises(ConfigError, match=r"NVLink-C2C .* not a link between GPUs"):
        intra_node_link(find_gpu("gh200"), "pcie", 4)


def test_mi300x_advice_names_infinity_fabric_never_nvlink(capsys):
    assert main(["plan", "--model", "qwen3-4b", "--gpus", "8", "--gpu", "mi300x"]) == 0
    out = capsys.readouterr().out
    assert "Infinity Fabric" in out and "NVLink" not in out
    req = make_request(build_parser().parse_args(["plan", "--model", "qwen3-4b", "--gpu", "mi300x"]))
    assert req.gpu.bf16_tflops == 1307.4 and req.gpu_memory == 192 * 1024**3
