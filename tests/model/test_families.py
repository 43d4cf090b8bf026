"""The family description (`distft.model.families`): what each family's presets build, and what
is refused before launch."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from distft.config import load_config
from distft.errors import ConfigError
from distft.model import PRESETS
from distft.model.families import FAMILIES, check_sequence_length, family_of, layer_types, sliding_window
from distft.parallel import check_model


@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if not p.hub_id])
def test_every_test_preset_builds_its_familys_layer(name):
    """Each random test preset is its family's transformers model, with the family's traits."""
    config = PRESETS[name].to_config()
    family = family_of(config)
    assert family.name == PRESETS[name].family and isinstance(config, family.config_class)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    attention = model.model.layers[0].self_attn
    assert hasattr(attention, "q_norm") == family.qk_norm
    assert (attention.q_proj.bias is not None) == family.qkv_bias
    assert attention.o_proj.bias is None  # no family distft trains has a row-parallel bias
    assert model.config.tie_word_embeddings == (model.lm_head.weight is model.model.embed_tokens.weight)


def test_the_presets_carry_what_makes_each_family_differ():
    assert {type(PRESETS[f"{f}-micro"].to_config()) for f in ("llama", "qwen2", "mistral")} == {
        LlamaConfig,
        Qwen2Config,
        MistralConfig,
    }
    assert isinstance(PRESETS["micro"].to_config(), Qwen3Config)
    assert PRESETS["llama-micro"].to_config().rope_parameters["rope_type"] == "llama3"
    assert not PRESETS["llama-micro"].tie_word_embeddings and not PRESETS["mistral-micro"].tie_word_embeddings
    assert PRESETS["qwen2-micro"].tie_word_embeddings and FAMILIES["qwen2"].biased == (
        "q_proj",
        "k_proj",
        "v_proj",
    )
    # Llama and Mistral configs list no layer types: every layer attends in full.
    assert layer_types(PRESETS["llama-micro"].to_config()) == ["full_attention"] * 4


def test_an_unknown_family_is_named_with_the_ones_distft_trains():
    config = Qwen3Config()
    config.model_type = "gemma3"
    with pytest.raises(ConfigError, match="'gemma3' architecture; distft trains the families qwen3") as err:
        family_of(config, "google/gemma-3-4b")
    assert "docs/architecture.md" in str(err.value)


def test_a_row_longer_than_an_active_sliding_window_is_refused_before_launch():
    v01 = MistralConfig(sliding_window=4096)  # Mistral 7B v0.1
    assert sliding_window(v01) == 4096
    check_sequence_length(v01, "mistral-v0.1", 4096)  # no row longer than the window: exact
    with pytest.raises(ConfigError, match=r"sliding window of 4096 tokens, and data\.max_length=8192"):
        check_sequence_length(v01, "mistral-v0.1", 8192)
    # Qwen2.5's configs carry a window that use_sliding_window=false leaves off.
    assert sliding_window(Qwen2Config(sliding_window=4096, use_sliding_window=False)) is None
    cfg = load_config(None, ["model.name=mistral-v0.1", "data.max_length=8192"])
    with pytest.raises(ConfigError, match="sliding window"):
        check_model(cfg, v01)
