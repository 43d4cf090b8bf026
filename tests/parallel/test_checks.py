"""Checks before launch that look at the strategy or the architecture: settings a strategy ignores
(a warning, `ignored_settings`) and LoRA targets the model lacks (a ConfigError, `check_model`)."""

import dataclasses

import pytest

from distft.config import Config, ParallelConfig, load_config
from distft.errors import ConfigError
from distft.layout.rules import READ_BY
from distft.model import model_config
from distft.parallel import STRATEGIES, check_model, ignored_settings
from distft.parallel.ddp import DDP
from distft.parallel.fsdp import FSDP
from distft.parallel.fsdp_pp import FSDPPipelineParallel
from distft.parallel.fsdp_tp import FSDPTensorParallel
from distft.parallel.pipeline import PipelineParallel

FAMILIES = {  # setting prefix -> the classes whose strategies read it
    "parallel.ddp_": (DDP,),
    "parallel.fsdp_": (FSDP, FSDPTensorParallel, FSDPPipelineParallel),
    "parallel.schedule": (PipelineParallel,),
    "parallel.microbatches": (PipelineParallel,),
    "parallel.stages_per_rank": (PipelineParallel,),
    "parallel.pp_split": (PipelineParallel,),
}


@pytest.mark.parametrize("key", sorted(READ_BY))
def test_the_table_names_registered_strategies_and_real_settings(key):
    section, name = key.split(".")
    assert name in {f.name for f in dataclasses.fields(ParallelConfig)} and section == "parallel"
    assert set(READ_BY[key]) <= set(STRATEGIES)
    for prefix, classes in FAMILIES.items():
        if key.startswith(prefix):  # the table agrees with the class hierarchy
            assert set(READ_BY[key]) == {n for n, c in STRATEGIES.items() if issubclass(c, classes)}


def test_defaults_and_settings_the_strategy_reads_warn_nothing():
    assert ignored_settings(Config()) == []
    cfg = load_config(None, ["parallel.strategy=pp", "parallel.schedule=gpipe", "parallel.microbatches=4"])
    assert ignored_settings(cfg) == []


@pytest.mark.parametrize(
    ("overrides", "warning"),
    [
        (
            ["parallel.strategy=ddp", "parallel.microbatches=4"],
            "parallel.microbatches=4 does nothing under --strategy ddp: only pp, ddp+pp, fsdp+pp, fsdp+tp+pp "
            "read it.",
        ),
        (
            ["parallel.strategy=fsdp", "parallel.ddp_static_graph=true"],
            "parallel.ddp_static_graph=true does nothing under --strategy fsdp: only ddp, zero1 read it.",
        ),
        (
            ["parallel.strategy=tp", "parallel.sequence_parallel=false"],
            "parallel.sequence_parallel=false does nothing under --strategy tp: only tp-sp reads it.",
        ),
        (
            ["parallel.timeout_s=60"],
            "parallel.timeout_s=60 does nothing under --strategy single: every strategy but single reads it.",
        ),
    ],
)
def test_a_setting_the_strategy_ignores_is_one_warning(overrides, warning):
    assert ignored_settings(load_config(None, overrides)) == [warning]


def test_lora_targets_the_model_lacks_are_refused():
    micro = model_config("micro")
    check_model(load_config(None, ["lora.target_modules=q_proj,lm_head"]), micro)
    check_model(load_config(None, ["train.method=full", "lora.target_modules=nothing"]), micro)  # no adapters
    with pytest.raises(ConfigError) as err:
        check_model(load_config(None, ["model.name=micro", "lora.target_modules=q_proj,qproj,c_attn"]), micro)
    assert str(err.value) == (
        "`lora.target_modules` names qproj, c_attn, which micro does not have: its Linear layers are "
        "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj. Did you mean `q_proj`?"
    )
