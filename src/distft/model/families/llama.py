"""Llama 3 / 3.1 / 3.2: no q/k norm, no biases, untied embeddings except the 1B and 3B of 3.2;
3.1 and 3.2 stretch rotary embeddings to 128K positions with the `llama3` rope scaling."""

from transformers import LlamaConfig

from distft.model.families.family import Family

# Llama 3.1 / 3.2's rope scaling, as in their released config.json.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 8.0,  # 32.0 in Llama 3.2
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

FAMILY = Family(
    name="llama",
    title="Llama 3 / 3.1 / 3.2",
    config_class=LlamaConfig,
    qk_norm=False,
    qkv_bias=False,
    defaults={
        "rope_parameters": LLAMA3_ROPE,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    },
)
