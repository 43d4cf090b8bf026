"""Positions past the model's: the reach of a config, YaRN written into the model and its recipe,
and the refusal before launch (the run's settings, the planner's flags)."""

import pytest
import torch

from distft.config import ModelConfig
from distft.errors import ConfigError
from distft.model import PRESETS, load_base_model
from distft.model.build import architecture, base_recipe, rebuild_base
from distft.model.positions import (
    check_positions,
    factor_for,
    max_positions,
    pretrained_positions,
    scale_rope,
)
from distft.plan.model_spec import resolve_model
from tests.helpers import run_cli


def test_reach_of_each_family_and_the_factor_that_stretches_it():
    qwen3 = PRESETS["qwen3-4b"].to_config()
    assert max_positions(qwen3) == 40_960 and pretrained_positions(qwen3) == 32_768  # the model card's
    assert factor_for(qwen3, 131_072) == 4 and factor_for(qwen3, 40_961) == 2
    scaled = scale_rope(qwen3, "yarn", 4.0)
    assert scaled.rope_parameters["rope_type"] == "yarn"
    assert scaled.rope_parameters["original_max_position_embeddings"] == 32_768
    assert max_positions(scaled) == scaled.max_position_embeddings == 131_072
    assert scale_rope(scaled, "yarn", 4.0) is scaled  # a saved config, scaled the same way: accepted
    llama31 = PRESETS["llama3-8b"].to_config()
    assert max_positions(llama31) == 131_072  # its own llama3 scaling
    with pytest.raises(ConfigError, match="already scales its rotary embeddings \\(llama3"):
        scale_rope(llama31, "yarn", 2.0, "llama3-8b")
    # A config.json as the planner reads it: the older `rope_scaling` key, `type` for `rope_type`.
    old = {"max_position_embeddings": 32_768, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert max_positions(old) == 65_536


def test_a_sequence_past_the_positions_is_refused_with_the_setting_that_fixes_it():
    qwen3 = PRESETS["qwen3-4b"].to_config()
    check_positions(qwen3, "Qwen3-4B", 40_960)  # the declared positions: accepted
    with pytest.raises(ConfigError) as err:
        check_positions(qwen3, "Qwen3-4B", 131_072)
    message = str(err.value)
    assert "data.max_length=131072 is longer than the 40,960 positions Qwen3-4B" in message
    assert "model.rope_scaling=yarn model.rope_factor=4 (131,072 positions)" in message
    assert "data.max_length=40960 (or less)" in message
    scaled = scale_rope(PRESETS["qwen3-4b"].to_config(), "yarn", 2.0)
    with pytest.raises(ConfigError, match=r"with its yarn scaling\. Set model\.rope_factor=4"):
        check_positions(scaled, "Qwen3-4B", 131_072)
    with pytest.raises(ConfigError, match=r"Set data\.max_length=131072 or less"):
        check_positions(PRESETS["llama3-8b"].to_config(), "Llama-3.1-8B", 262_144)


def test_yarn_is_built_into_the_model_and_rebuilt_from_its_recipe():
    cfg = ModelConfig(name="micro", rope_scaling="yarn", rope_factor=2.0)
    assert architecture(cfg).max_position_embeddings == 2 * PRESETS["micro"].max_position_embeddings
    plain, scaled = load_base_model(ModelConfig(name="micro")), load_base_model(cfg)
    rotary, plain_rotary = scaled.model.rotary_emb, plain.model.rotary_emb
    assert scaled.config.rope_parameters["rope_type"] == "yarn"
    assert rotary.attention_scaling > 1  # YaRN's temperature
    assert not torch.equal(rotary.inv_freq, plain_rotary.inv_freq)  # the low frequencies interpolated
    assert torch.equal(rotary.inv_freq[0], plain_rotary.inv_freq[0])  # the highest kept
    # The same random weights: scaling changes positions, not the initialisation.
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), scaled.parameters(), strict=True))
    recipe = base_recipe(cfg)
    assert (recipe["rope_scaling"], recipe["rope_factor"]) == ("yarn", 2.0)
    rebuilt = rebuild_base(recipe)
    assert rebuilt.config.max_position_embeddings == scaled.config.max_position_embeddings
    assert torch.equal(rebuilt.model.rotary_emb.inv_freq, rotary.inv_freq)
    assert "rope_scaling" not in base_recipe(ModelConfig(name="micro"))  # older recipes read the same
    # Positions past the preset's 4,096 run (the forward is the model's own; loss finite).
    ids = torch.randint(0, 1000, (1, 16))
    positions = torch.arange(6000, 6016).unsqueeze(0)
    assert torch.isfinite(scaled(input_ids=ids, position_ids=positions).logits).all()


def test_train_and_plan_refuse_before_launch_and_accept_the_fix(tmp_path):
    proc = run_cli("train", "--model", "micro", "data.max_length=8192", "--out", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr
    assert "model.rope_scaling=yarn model.rope_factor=2 (8,192 positions)" in proc.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written
    proc = run_cli("train", "model.rope_factor=2", "--out", str(tmp_path / "run"))
    assert proc.returncode == 2 and "does nothing without model.rope_scaling" in proc.stderr
    plan = [
        "plan",
        "--model",
        "Qwen/Qwen3-4B",
        "--gpu",
        "h200",
        "--seq-len",
        "131072",
        "--activation-checkpointing",
    ]
    proc = run_cli(*plan)
    assert proc.returncode == 2
    assert "--rope-scaling yarn --rope-factor 4 (131,072 positions)" in proc.stderr
    proc = run_cli(*plan, "--rope-scaling", "yarn", "--rope-factor", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "model.rope_scaling=yarn model.rope_factor=4" in proc.stdout  # the run: line carries it
    assert resolve_model("Qwen/Qwen3-4B").rotary["max_position_embeddings"] == 40_960
