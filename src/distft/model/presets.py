"""The one table of architectures distft knows offline: presets of every family, real sizes and test sizes.

A preset is an architecture only, randomly initialised from `model.seed`, of one family
(`distft.model.families`). The real sizes are here (config only) so benchmarks and the planner
work offline, each with the hub id of its released weights and the other names it goes by
(`aliases`: instruct variants, short names), Llama 2 and Llama 3 70B included. `tiny` trains on
two CPU cores in minutes and `micro` serves the test suite; both keep Qwen3-4B's architectural choices: tied
embeddings, q/k RMSNorm, grouped KV heads, and a head_dim decoupled from hidden_size / num_heads.
`llama-micro`, `qwen2-micro` and `mistral-micro` (and `-tiny`) are the same sizes in the other
families, each with what makes its family differ: untied embeddings and Llama 3.1's rope scaling
(llama), q/k/v biases (qwen2), untied embeddings (mistral). `tiny` and its family copies keep the
bundled Qwen3 tokenizer's vocabulary and token ids; the `micro` presets tokenize with the same BPE
cut to its first 4,064 ranks (`tokenizer_ranks`, `distft.data.tokenizer`): a 4,096-row vocabulary,
where Qwen3's 151,936 rows would be 98% of a micro model's weights and nearly all of a test step's
work (its logits). The real sizes have their own. The planner derives its model specs from this
table too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig

from distft.model.families import FAMILIES
from distft.model.families.llama import LLAMA3_ROPE

QWEN3_VOCAB = 151_936  # embedding rows in every Qwen3 checkpoint (tokenizer uses 151,669 of them)
# The bundled tokenizer's ids (<|endoftext|>, <|im_end|>): every random test preset uses them.
QWEN3_TOKENS = {"bos_token_id": 151_643, "eos_token_id": 151_645, "pad_token_id": 151_643}


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
    family: str = "qwen3"
    vocab_size: int = QWEN3_VOCAB
    # Config fields on top of the family's defaults: token ids, rope, what a release sets.
    extra: dict = field(default_factory=lambda: dict(QWEN3_TOKENS))
    # Other names of the released model the planner knows offline (instruct variants: the same
    # shapes); one with an owner/ is a hub id, one without a short name for `hub_id`.
    aliases: tuple[str, ...] = ()
    # The bundled tokenizer cut to Qwen's first N ranks (`distft.data.tokenizer`); None: all of them.
    tokenizer_ranks: int | None = None

    def to_config(self) -> PretrainedConfig:
        return FAMILIES[self.family].build_config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            use_cache=False,
            initializer_range=self.initializer_range,
            **self.extra,
        )


def _test_size(base: Preset, family: str, tie: bool, **extra) -> Preset:
    """`micro` or `tiny` in another family: the same shapes, the family's own layer."""
    return Preset(
        base.hidden_size, base.intermediate_size, base.num_hidden_layers, base.num_attention_heads,
        base.num_key_value_heads, base.hidden_size // base.num_attention_heads, tie,
        max_position_embeddings=base.max_position_embeddings, initializer_range=base.initializer_range,
        family=family, vocab_size=base.vocab_size, extra={**base.extra, **extra},
        tokenizer_ranks=base.tokenizer_ranks,
    )  # fmt: skip


# The test presets' tokenizer: Qwen's first 4,064 ranks, its 26 added tokens after them (4,064..
# 4,089), and an embedding of 4,096 rows (Qwen pads its own to a multiple of 128 too).
MICRO_RANKS = 4_064
MICRO_VOCAB = 4_096
MICRO_TOKENS = {"bos_token_id": MICRO_RANKS, "eos_token_id": MICRO_RANKS + 2, "pad_token_id": MICRO_RANKS}
# Test-suite model: 4 layers so pipeline tests can place 2 virtual stages on each of 2 ranks.
MICRO = Preset(
    32, 96, 4, 4, 2, 8, True, max_position_embeddings=4096, initializer_range=0.1,
    vocab_size=MICRO_VOCAB, extra=MICRO_TOKENS, tokenizer_ranks=MICRO_RANKS,
)  # fmt: skip
# Default CPU model: Qwen3-4B's shape ratios (4:1 grouped KV, ~3.8x MLP, head_dim decoupled).
# A wider init than Qwen's 0.02 lets a frozen random base reach confident logits through LoRA
# alone (tied 64-dim embeddings at 0.02 cap every logit near +-1.3, so the loss cannot fall).
TINY = Preset(64, 192, 4, 8, 2, 16, True, max_position_embeddings=4096, initializer_range=0.1)
# Llama 3.1's rope scaling at a test size: rescaled from 1,024 positions, so it changes the
# rotary frequencies of every row longer than a few tokens.
TEST_LLAMA_ROPE = {"rope_parameters": {**LLAMA3_ROPE, "original_max_position_embeddings": 1024}}

_LLAMA31 = {"bos_token_id": 128_000, "eos_token_id": 128_001}  # the base models' ids
_MOE_MICRO = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24}
# Llama 3.0 (no rope scaling) and Llama 2: the planner's examples in the blog series; no weights
# are trained offline at these sizes, so only what the planner counts is checked against releases.
_LLAMA30 = {**_LLAMA31, "rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0}}
_LLAMA2 = {
    "bos_token_id": 1,
    "eos_token_id": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
}

# One table for every architecture the tool knows offline. Real sizes from the released configs.
PRESETS: dict[str, Preset] = {
    "micro": MICRO,
    "tiny": TINY,
    "qwen3-0.6b": Preset(1024, 3072, 28, 16, 8, 128, True, "Qwen/Qwen3-0.6B"),
    "qwen3-1.7b": Preset(2048, 6144, 28, 16, 8, 128, True, "Qwen/Qwen3-1.7B"),
    "qwen3-4b": Preset(2560, 9728, 36, 32, 8, 128, True, "Qwen/Qwen3-4B"),
    "qwen3-8b": Preset(4096, 12288, 36, 32, 8, 128, False, "Qwen/Qwen3-8B"),
    "qwen3-14b": Preset(5120, 17408, 40, 40, 8, 128, False, "Qwen/Qwen3-14B"),
    "qwen3-32b": Preset(5120, 25600, 64, 64, 8, 128, False, "Qwen/Qwen3-32B"),
    **{
        f"{family}-{size}": _test_size(base, family, tie, **extra)
        for size, base in (("micro", MICRO), ("tiny", TINY))
        for family, tie, extra in (
            ("llama", False, TEST_LLAMA_ROPE),
            ("qwen2", True, {}),
            ("mistral", False, {}),
        )
    },
    # Qwen3-MoE: `micro`'s attention and 8 experts of which each token takes 2 (Qwen3-30B-A3B's 128
    # and 8 in miniature).
    "qwen3-moe-micro": Preset(
        32, 96, 4, 4, 2, 8, True, max_position_embeddings=4096, initializer_range=0.1, family="qwen3_moe",
        vocab_size=MICRO_VOCAB, extra={**MICRO_TOKENS, **_MOE_MICRO}, tokenizer_ranks=MICRO_RANKS,
    ),
    "qwen3-30b-a3b": Preset(
        2048, 6144, 48, 32, 4, 128, False, "Qwen/Qwen3-30B-A3B", family="qwen3_moe",
        extra={**QWEN3_TOKENS, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    ),
    "llama3-8b": Preset(
        4096, 14336, 32, 32, 8, 128, False, "meta-llama/Llama-3.1-8B", 131_072,
        family="llama", vocab_size=128_256, extra=_LLAMA31,
        aliases=("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b",
                 # Llama 3: Llama 3.1's shapes without its rope scaling
                 "meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B-Instruct", "llama-3-8b"),
    ),
    "llama3.2-3b": Preset(
        3072, 8192, 28, 24, 8, 128, True, "meta-llama/Llama-3.2-3B", 131_072,
        family="llama", vocab_size=128_256,
        extra={**_LLAMA31, "rope_parameters": {**LLAMA3_ROPE, "factor": 32.0}},
        aliases=("meta-llama/Llama-3.2-3B-Instruct",),
    ),
    "llama3-70b": Preset(
        8192, 28672, 80, 64, 8, 128, False, "meta-llama/Meta-Llama-3-70B", 8192,
        family="llama", vocab_size=128_256, extra=_LLAMA30,
        aliases=("meta-llama/Meta-Llama-3-70B-Instruct", "llama-3-70b"),
    ),
    "llama3.1-70b": Preset(
        8192, 28672, 80, 64, 8, 128, False, "meta-llama/Llama-3.1-70B", 131_072,
        family="llama", vocab_size=128_256, extra=_LLAMA31, aliases=("meta-llama/Llama-3.1-70B-Instruct",),
    ),
    "llama2-7b": Preset(
        4096, 11008, 32, 32, 32, 128, False, "meta-llama/Llama-2-7b-hf", 4096,
        family="llama", vocab_size=32_000, extra=_LLAMA2, aliases=("llama-2-7b",),
    ),
    "llama2-13b": Preset(
        5120, 13824, 40, 40, 40, 128, False, "meta-llama/Llama-2-13b-hf", 4096,
        family="llama", vocab_size=32_000, extra=_LLAMA2, aliases=("llama-2-13b",),
    ),
    "llama2-70b": Preset(
        8192, 28672, 80, 64, 8, 128, False, "meta-llama/Llama-2-70b-hf", 4096,
        family="llama", vocab_size=32_000, extra=_LLAMA2, aliases=("llama-2-70b",),
    ),
    "qwen2.5-7b": Preset(
        3584, 18944, 28, 28, 4, 128, False, "Qwen/Qwen2.5-7B", 131_072,
        family="qwen2", vocab_size=152_064, extra={"bos_token_id": 151_643, "eos_token_id": 151_643},
        aliases=("Qwen/Qwen2.5-7B-Instruct",),
    ),
    "mistral-7b": Preset(
        4096, 14336, 32, 32, 8, 128, False, "mistralai/Mistral-7B-v0.3", 32_768,
        family="mistral", vocab_size=32_768, extra={"bos_token_id": 1, "eos_token_id": 2},
        aliases=("mistralai/Mistral-7B-Instruct-v0.3",),
    ),
}  # fmt: skip

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def is_preset(name: str) -> bool:
    return name in PRESETS


def tokenizer_ranks(name: str) -> int | None:
    """How many of Qwen's ranks the offline tokenizer of preset `name` keeps (None: all, or no preset)."""
    return PRESETS[name].tokenizer_ranks if name in PRESETS else None
