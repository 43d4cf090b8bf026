"""The planner's offline table is the presets' (`distft.plan.model_spec`): every released preset
under its hub id and its aliases, each with the figures of its release's config.json."""

from dataclasses import replace

import pytest

from distft.model import PRESETS
from distft.plan.model_spec import builtin_table, resolve_model

# hub id: (family, hidden, MLP, layers, heads, KV heads, head_dim, vocab, tied embeddings), as in the
# release's config.json. Written here once more on purpose: a preset edited by mistake fails here.
RELEASED = {
    "Qwen/Qwen3-0.6B": ("qwen3", 1024, 3072, 28, 16, 8, 128, 151936, True),
    "Qwen/Qwen3-1.7B": ("qwen3", 2048, 6144, 28, 16, 8, 128, 151936, True),
    "Qwen/Qwen3-4B": ("qwen3", 2560, 9728, 36, 32, 8, 128, 151936, True),
    "Qwen/Qwen3-8B": ("qwen3", 4096, 12288, 36, 32, 8, 128, 151936, False),
    "Qwen/Qwen3-14B": ("qwen3", 5120, 17408, 40, 40, 8, 128, 151936, False),
    "Qwen/Qwen3-32B": ("qwen3", 5120, 25600, 64, 64, 8, 128, 151936, False),
    "Qwen/Qwen3-30B-A3B": ("qwen3_moe", 2048, 6144, 48, 32, 4, 128, 151936, False),
    "meta-llama/Llama-3.1-8B": ("llama", 4096, 14336, 32, 32, 8, 128, 128256, False),
    "meta-llama/Llama-3.2-3B": ("llama", 3072, 8192, 28, 24, 8, 128, 128256, True),
    "meta-llama/Meta-Llama-3-70B": ("llama", 8192, 28672, 80, 64, 8, 128, 128256, False),
    "meta-llama/Llama-3.1-70B": ("llama", 8192, 28672, 80, 64, 8, 128, 128256, False),
    "meta-llama/Llama-2-7b-hf": ("llama", 4096, 11008, 32, 32, 32, 128, 32000, False),
    "meta-llama/Llama-2-13b-hf": ("llama", 5120, 13824, 40, 40, 40, 128, 32000, False),
    "meta-llama/Llama-2-70b-hf": ("llama", 8192, 28672, 80, 64, 8, 128, 32000, False),
    "Qwen/Qwen2.5-7B": ("qwen2", 3584, 18944, 28, 28, 4, 128, 152064, False),
    "mistralai/Mistral-7B-v0.3": ("mistral", 4096, 14336, 32, 32, 8, 128, 32768, False),
}  # fmt: skip


@pytest.mark.parametrize("hub_id", RELEASED)
def test_a_released_model_plans_offline_with_its_releases_figures(hub_id):
    s = resolve_model(hub_id)
    figures = (s.family, s.hidden_size, s.intermediate_size, s.num_layers, s.num_heads, s.num_kv_heads)
    assert (*figures, s.head_dim, s.vocab_size, s.tie_word_embeddings) == RELEASED[hub_id]
    assert (s.name, s.source) == (hub_id, "built-in table")


def test_the_table_is_every_released_preset_under_its_hub_id_and_aliases():
    assert set(RELEASED) == {p.hub_id for p in PRESETS.values() if p.hub_id}
    table, names = builtin_table(), 0
    for key, preset in PRESETS.items():
        if not preset.hub_id:
            continue
        spec = replace(resolve_model(key), name=preset.hub_id, source="built-in table")
        assert table[preset.hub_id.lower()] == spec
        for alias in preset.aliases:  # a hub id names itself; a short name, the release
            assert resolve_model(alias) == replace(spec, name=alias if "/" in alias else preset.hub_id)
        names += 1 + len(preset.aliases)
    assert len(table) == names  # no name lost to another
