"""Qwen3 (0.6B to 32B dense): q/k RMSNorm per head, no biases, embeddings tied up to 4B."""

from transformers import Qwen3Config

from distft.model.families.family import Family

FAMILY = Family(
    name="qwen3",
    title="Qwen3",
    config_class=Qwen3Config,
    qk_norm=True,
    qkv_bias=False,
    defaults={
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
    },
    # 40,960 declared = 32,768 of context + 8,192 for the answer; YaRN scales from 32,768 (model card).
    pretrained_context={40_960: 32_768},
)
