"""Each strategy is described once, by its spec (`distft.layout.SPECS`); the runtime's classes
point at it, and the README, the planner and the checks before launch read it."""

from __future__ import annotations

from pathlib import Path

import pytest

from distft.config import load_config
from distft.errors import ConfigError
from distft.layout import DIMS, SPECS, ParallelDims, takers
from distft.layout.rules import READ_BY
from distft.layout.strategies import strategy_table
from distft.parallel import STRATEGIES, check_config

ROOT = Path(__file__).resolve().parents[2]


def layout_overrides(name: str, nproc: int = 4) -> list[str]:
    """A valid layout of `name` on `nproc` processes (one where it runs in one)."""
    spec = SPECS[name]
    out = [f"parallel.strategy={name}", f"parallel.nproc={nproc if spec.distributed else 1}"]
    if spec.sized:
        out += ["parallel.pp=2"] if "pp" in spec.dims else []
        out += ["parallel.tp=2"] if "tp" in spec.dims else []
        out += ["parallel.dp=2"] if "cp" in spec.dims else []  # cp takes what dp leaves
    out += [f"parallel.shard={1 if 'tp' in spec.dims else 2}"] if spec.shard_groups else []  # 2 replicas
    out += ["parallel.ep=2"] if spec.expert_groups else []
    return out


def test_every_class_points_at_its_spec_and_the_readme_shows_every_spec():
    assert list(STRATEGIES) == list(SPECS), "a strategy needs its class and its spec, in the same order"
    for name, cls in STRATEGIES.items():
        spec = cls.spec
        assert spec is SPECS[name] and spec.label and spec.holds and spec.moves, name
        assert set(spec.dims) <= set(DIMS), name
        if spec.page:
            assert (ROOT / "docs" / spec.page.split("#")[0]).is_file(), (name, spec.page)
    assert strategy_table() in (ROOT / "README.md").read_text(), (
        "README.md's strategy table differs from the specs': paste `distft.layout.strategies.strategy_table()`"
    )


@pytest.mark.parametrize("feature", ["qlora", "dora", "compile", "fp32_masters"])
def test_the_checks_before_launch_refuse_exactly_what_a_spec_says_it_cannot_run(feature):
    """A capability is a fact the checks act on: every strategy that says it runs `feature` passes
    them with it, every other is refused with its spec's reason."""
    setting = {
        "qlora": ["train.method=qlora"],
        "dora": ["lora.variant=dora"],
        "compile": ["model.compile=true"],
        "fp32_masters": ["train.method=full", "model.dtype=bfloat16", "train.master_weights=fp32"],
    }[feature]
    assert takers(feature) and len(takers(feature)) < len(SPECS), feature
    for name, spec in SPECS.items():
        cfg = load_config(None, layout_overrides(name) + setting + ["train.global_batch_size=16"])
        if spec.runs(feature):
            check_config(cfg)
        else:
            with pytest.raises(ConfigError) as refused:
                check_config(cfg)
            said = " ".join(str(refused.value).split())
            assert feature != "qlora" or spec.refusal(feature) in said, (name, said)


def test_settings_each_strategy_reads_follow_from_its_spec():
    assert set(READ_BY["parallel.schedule"]) == {"pp", "ddp+pp", "fsdp+pp", "fsdp+tp+pp"}
    assert set(READ_BY["parallel.ddp_no_sync"]) == {"ddp", "zero1"}
    fsdp = {"fsdp", "zero2", "hsdp", "fsdp+tp", "fsdp+pp", "fsdp+tp+pp", "fsdp+cp", "fsdp+ep", "hsdp+tp"}
    assert set(READ_BY["parallel.fsdp_prefetch"]) == fsdp
    assert READ_BY["parallel.sequence_parallel"] == ("tp-sp",)
    assert "single" not in READ_BY["parallel.timeout_s"]


def test_one_layout_for_every_strategy_read_from_its_config_and_written_back():
    """`ParallelDims.of` gives every strategy's degrees (the user's mesh on several axes, every rank
    on its one, one process without any; HSDP's shard groups and fsdp+ep's expert groups as
    dimensions), and `to_overrides` writes settings that give the same degrees back."""
    for name, spec in SPECS.items():
        cfg = load_config(None, layout_overrides(name))
        dims = ParallelDims.of(spec, cfg)
        assert dims.world_size == cfg.world_size, name
        assert {d for d, v in dims.degrees().items() if v > 1} <= set(spec.dims), name
        if len(spec.dims) == 1:
            assert dims.degrees()[spec.dims[0]] == 4, name
        if spec.shard_groups:
            assert dims.dp_replicate == 2 and dims.dp_shard * dims.tp == 2, name
        if spec.expert_groups:
            assert (dims.dp_shard, dims.ep) == (4, 2), name
        back = [f"{k}={v}" for k, v in dims.to_overrides(spec).items()]
        assert ParallelDims.of(spec, load_config(None, layout_overrides(name)[:2] + back)) == dims, name


def test_the_groups_of_ranks_along_each_dimension():
    fsdp_tp = ParallelDims(dp_shard=2, tp=2)  # tp innermost: neighbouring ranks
    assert fsdp_tp.group("tp", 2) == [2, 3] and fsdp_tp.group("dp", 1) == [1, 3]
    assert fsdp_tp.coordinates(3) | {"pp": 0} == {
        "pp": 0,
        "dp_replicate": 0,
        "dp_shard": 1,
        "cp": 0,
        "tp": 1,
        "dp": 1,
        "ep": 0,
    }
    hsdp = ParallelDims(dp_replicate=2, dp_shard=2)  # shard groups of neighbours, replicas apart
    assert hsdp.group("dp_shard", 2) == [2, 3] and hsdp.group("dp_replicate", 1) == [1, 3]
    assert hsdp.group("dp", 0) == [0, 1, 2, 3]
    experts = ParallelDims(dp_shard=4, ep=2)  # expert groups of neighbours
    assert experts.group("ep", 3) == [2, 3] and experts.coordinates(3)["ep"] == 1
    pipelines = ParallelDims(pp=2, dp_replicate=2)  # pp outermost
    assert pipelines.group("pp", 1) == [1, 3] and pipelines.group("dp", 2) == [2, 3]
    with pytest.raises(ConfigError, match="expert group"):
        ParallelDims(dp_shard=4, ep=3)
    with pytest.raises(ConfigError, match="at least 1"):
        ParallelDims(tp=0)
