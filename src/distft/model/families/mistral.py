"""Mistral 7B: the Llama layer (no q/k norm, no biases, untied embeddings); v0.1 attends through a
sliding window of 4096 tokens, v0.3 (the presets' shape) has none."""

from transformers import MistralConfig

from distft.model.families.family import Family

FAMILY = Family(
    name="mistral",
    title="Mistral 7B",
    config_class=MistralConfig,
    qk_norm=False,
    qkv_bias=False,
    defaults={
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "sliding_window": None,
    },
)
