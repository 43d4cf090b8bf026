"""Qwen2 / Qwen2.5: biases on q_proj, k_proj and v_proj (and none elsewhere), no q/k norm,
embeddings tied up to 3B; the configs carry a sliding window that `use_sliding_window=false`
leaves off."""

from transformers import Qwen2Config

from distft.model.families.family import Family

FAMILY = Family(
    name="qwen2",
    title="Qwen2.5",
    config_class=Qwen2Config,
    qk_norm=False,
    qkv_bias=True,
    defaults={
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "use_sliding_window": False,
    },
)
