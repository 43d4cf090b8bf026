"""The one table of architectures distft knows offline: Qwen3 presets, real sizes and test sizes.

A preset is an architecture only, randomly initialised from `model.seed`. The real Qwen3 sizes are
here (config only) so benchmarks and the planner work offline; `tiny` trains on two CPU cores in
minutes and `micro` serves the test suite. Both keep Qwen3-4B's architectural choices: tied
embeddings, q/k RMSNorm, grouped KV heads, and a head_dim decoupled from hidden_size / num_heads.
The planner derives its model specs from this table too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Qwen3Config

QWEN3_VOCAB = 151_936  # embedding rows in every Qwen3 checkpoint (tokenizer uses 151,669 of them)


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    hub_id: str = ""  # where the real weights live, for presets that mirror a released model
    max_position_embeddings: int = 40_960
    initializer_range: float = 0.02  # std of the random init (real checkpoints overwrite it)

    def to_config(self) -> Qwen3Config:
        return Qwen3Config(
            vocab_size=QWEN3_VOCAB,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            hidden_act="silu",
            attention_bias=False,
            bos_token_id=151_643,
            eos_token_id=151_645,
            pad_token_id=151_643,
            use_cache=False,
            initializer_range=self.initializer_range,
        )


# One table for every architecture the tool knows offline. Real sizes from the released configs.
PRESETS: dict[str, Preset] = {
    # Test-suite model: 4 layers so pipeline tests can place 2 virtual stages on each of 2 ranks.
    "micro": Preset(32, 96, 4, 4, 2, 8, True, max_position_embeddings=4096, initializer_range=0.1),
    # Default CPU model: Qwen3-4B's shape ratios (4:1 grouped KV, ~3.8x MLP, head_dim decoupled).
    # A wider init than Qwen's 0.02 lets a frozen random base reach confident logits through LoRA
    # alone (tied 64-dim embeddings at 0.02 cap every logit near +-1.3, so the loss cannot fall).
    "tiny": Preset(64, 192, 4, 8, 2, 16, True, max_position_embeddings=4096, initializer_range=0.1),
    "qwen3-0.6b": Preset(1024, 3072, 28, 16, 8, 128, True, "Qwen/Qwen3-0.6B"),
    "qwen3-1.7b": Preset(2048, 6144, 28, 16, 8, 128, True, "Qwen/Qwen3-1.7B"),
    "qwen3-4b": Preset(2560, 9728, 36, 32, 8, 128, True, "Qwen/Qwen3-4B"),
    "qwen3-8b": Preset(4096, 12288, 36, 32, 8, 128, False, "Qwen/Qwen3-8B"),
    "qwen3-14b": Preset(5120, 17408, 40, 40, 8, 128, False, "Qwen/Qwen3-14B"),
    "qwen3-32b": Preset(5120, 25600, 64, 64, 8, 128, False, "Qwen/Qwen3-32B"),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def is_preset(name: str) -> bool:
    return name in PRESETS
