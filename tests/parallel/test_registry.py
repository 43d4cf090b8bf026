"""Each strategy describes itself once, on its class; the README, the planner and the checks
before launch read that description from the registry."""

from __future__ import annotations

from pathlib import Path

from distft.config import load_config
from distft.parallel import STRATEGIES
from distft.parallel.checks import READ_BY
from distft.parallel.dims import ParallelDims
from distft.parallel.registry import strategy_table
from distft.plan.estimate import LABELS, MODELLED

ROOT = Path(__file__).resolve().parents[2]


def test_every_strategy_describes_itself_and_the_readme_shows_it():
    for name, cls in STRATEGIES.items():
        assert cls.label and cls.holds and cls.moves, name
        assert set(cls.dims) <= {"dp", "tp", "pp", "cp"} and len(set(cls.dims)) == len(cls.dims), name
        assert cls.shards in ("none", "optimizer", "full"), name
        assert cls.tensor_parallel in ("", "dtensor", "megatron") and bool(cls.tensor_parallel) == (
            "tp" in cls.dims
        ), name
        assert cls.wraps in ("", "ddp", "fully_shard"), name
        assert cls.distributed == bool(cls.dims), name
        if cls.page:
            assert (ROOT / "docs" / cls.page.split("#")[0]).is_file(), (name, cls.page)
    assert strategy_table() in (ROOT / "README.md").read_text(), (
        "README.md's strategy table differs from the registry's: paste `distft.parallel.registry.strategy_table()`"
    )
    # The planner models exactly the registry, in its order, under the classes' names.
    assert tuple(STRATEGIES) == MODELLED
    assert {n: c.label for n, c in STRATEGIES.items()} == LABELS


def test_settings_each_strategy_reads_follow_from_its_class():
    assert set(READ_BY["parallel.schedule"]) == {"pp", "ddp+pp", "fsdp+pp", "fsdp+tp+pp"}
    assert set(READ_BY["parallel.ddp_no_sync"]) == {"ddp", "zero1"}
    assert set(READ_BY["parallel.fsdp_prefetch"]) == {
        "fsdp",
        "zero2",
        "hsdp",
        "fsdp+tp",
        "fsdp+pp",
        "fsdp+tp+pp",
        "fsdp+cp",
        "fsdp+ep",
    }
    assert READ_BY["parallel.sequence_parallel"] == ("tp-sp",)
    assert "single" not in READ_BY["parallel.timeout_s"]


def test_one_mesh_description_for_every_strategy():
    """`ParallelDims.of` gives every strategy's degrees: the user's mesh on several dimensions,
    every rank on its one dimension, one process without any."""
    for name, cls in STRATEGIES.items():
        overrides = [f"parallel.strategy={name}", "parallel.nproc=4"]
        if cls.mesh_degrees:
            overrides += ["parallel.pp=2"] if "pp" in cls.dims else []
            overrides += ["parallel.tp=2"] if "tp" in cls.dims else []
            overrides += ["parallel.dp=2"] if "cp" in cls.dims else []  # cp takes what dp leaves
        if not cls.distributed:
            overrides[1] = "parallel.nproc=1"
        dims = ParallelDims.of(cls.dims, load_config(None, overrides))
        degrees = {"dp": dims.dp, "tp": dims.tp, "pp": dims.pp, "cp": dims.cp}
        assert dims.world_size == dims.dp * dims.tp * dims.pp * dims.cp, name
        assert {d for d, v in degrees.items() if v > 1} <= set(cls.dims), name
        if len(cls.dims) == 1:
            assert degrees[cls.dims[0]] == 4, name
        if "cp" in cls.dims and cls.mesh_degrees:
            assert (dims.dp, dims.cp) == (2, 2), name
