"""Qwen3 models: the preset table, building or loading a model, LoRA, and the loss head.

`--model` takes one of three things:
- a preset from `PRESETS`: an architecture only, randomly initialised from `model.seed`. The real
  Qwen3 sizes are here (config only) so benchmarks and the planner work offline; `tiny` trains on
  two CPU cores in minutes and `micro` serves the test suite. Both keep Qwen3-4B's architectural
  choices: tied embeddings, q/k RMSNorm, grouped KV heads, and a head_dim decoupled from
  hidden_size / num_heads;
- a local directory with config.json + safetensors;
- a hub id, loaded with transformers (and failing with a clear message when offline).

`SummaryLM` wraps the causal LM so that its forward returns the summed cross-entropy over the
labelled (summary) positions. Only those positions go through lm_head: with Qwen3's 151,936-token
vocabulary the logits of the whole prompt would dominate memory for nothing, since the prompt
carries no loss. Every strategy wraps a `SummaryLM`, so DDP/FSDP hooks see one forward.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, Qwen3Config, Qwen3ForCausalLM

from distft.config import Config, ModelConfig
from distft.errors import ConfigError

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


def model_config(name: str) -> PretrainedConfig:
    """The architecture of `name` without loading weights (preset, local dir, or hub id)."""
    if name in PRESETS:
        return PRESETS[name].to_config()
    if Path(name).is_dir():
        if not (Path(name) / "config.json").is_file():
            raise ConfigError(f"Model directory {name} has no config.json.")
        return AutoConfig.from_pretrained(name)
    try:
        return AutoConfig.from_pretrained(name, local_files_only=hub_offline())
    except OSError as err:
        raise ConfigError(_unreachable_model_message(name, err)) from None


def hub_offline() -> bool:
    """True when the Hugging Face hub cannot be used: HF_HUB_OFFLINE is set, or its host does not
    accept a connection within 3 s.

    Without the probe an unreachable hub costs huggingface_hub's five retries (~30 s) per file
    before failing; with it, hub ids load from the local cache at once (`local_files_only`), and
    an uncached one fails in seconds. Behind a proxy the probe cannot tell, so it is skipped.
    """
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return True
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=3).close()
    except OSError:
        return True
    return False


def _unreachable_model_message(name: str, err: Exception) -> str:
    offline = hub_offline() or "offline" in str(err).lower() or "connect" in str(err).lower()
    why = (
        "the Hugging Face hub cannot be reached (offline: HF_HUB_OFFLINE is set or there is no network), "
        "and it is not in the local cache"
        if offline
        else f"loading it failed ({str(err).splitlines()[0]})"
    )
    return (
        f"Model {name!r} is not a preset, not a local directory, and {why}. "
        f"Use a preset ({', '.join(PRESETS)}), or download the model where there is network "
        f"(`hf download {name} --local-dir DIR`) and point --model at DIR, the directory holding its "
        "config.json and *.safetensors."
    )


def load_base_model(cfg: ModelConfig) -> nn.Module:
    """The causal LM named by `cfg.name`, in `cfg.dtype`, on CPU (strategies move it)."""
    dtype = DTYPES[cfg.dtype]
    kwargs = {"dtype": dtype, "attn_implementation": cfg.attn_implementation}
    if cfg.name in PRESETS:
        # Seeded init so every rank (and every strategy) starts from the same random weights.
        config = PRESETS[cfg.name].to_config()
        config._attn_implementation = cfg.attn_implementation
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = Qwen3ForCausalLM(config)
        model = model.to(dtype)
    else:
        if not Path(cfg.name).is_dir():
            kwargs["local_files_only"] = hub_offline()
        try:
            model = AutoModelForCausalLM.from_pretrained(cfg.name, **kwargs)
        except OSError as err:
            raise ConfigError(_unreachable_model_message(cfg.name, err)) from None
    model.config.use_cache = False  # training never uses the KV cache; it only costs memory
    return model


def apply_method(model: nn.Module, cfg: Config) -> nn.Module:
    """LoRA: freeze the base and inject adapters (peft). QLoRA: the same on a base whose decoder
    projections are 4-bit NF4 (`distft.quant`). Full: every weight trains."""
    if cfg.train.method == "full":
        model.requires_grad_(True)
        return model
    from peft import LoraConfig, get_peft_model

    if cfg.train.method == "qlora":
        from distft.quant import NF4Spec, quantize_base

        quantize_base(model, NF4Spec.from_config(cfg.model))  # before PEFT wraps the projections

    lora = LoraConfig(
        r=cfg.lora.rank,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=list(cfg.lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, lora)
    # peft initialises lora_A from the global RNG: the caller seeds it so every rank agrees.
    return peft_model


def causal_lm(model: nn.Module) -> Qwen3ForCausalLM:
    """The transformers model inside any peft wrapper."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        return model.base_model.model
    return model


class SummaryLM(nn.Module):
    """A causal LM whose forward returns (sum of token losses, number of labelled tokens).

    `labels` are already shifted: labels[b, t] is the token that position t must predict, or -100.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm  # the peft model (LoRA) or the plain causal LM (full); saved as-is
        inner = causal_lm(lm)
        self.backbone = inner.model  # Qwen3Model: embeddings, decoder layers, final norm
        self.lm_head = inner.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,  # (batch, seq)
        attention_mask: torch.Tensor,  # (batch, seq), 1 for real tokens
        labels: torch.Tensor,  # (batch, seq), shifted, -100 where no loss
    ) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return summed_loss(hidden, self.lm_head, labels)


def summed_loss(hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over labelled positions; lm_head runs on those positions only."""
    keep = labels != -100
    logits = lm_head(hidden[keep]).float()  # (n_labelled, vocab); fp32 for a stable softmax
    return F.cross_entropy(logits, labels[keep], reduction="sum")


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total
