"""Building the model a run trains: the base (preset, local directory or hub id), then the method.

`--model` takes one of three things:
- a preset from `distft.model.presets.PRESETS`: an architecture, randomly initialised from
  `model.seed`, identically on every rank;
- a local directory with config.json + safetensors;
- a hub id, loaded with transformers (and failing with a clear message when offline).

`apply_method` then turns the base into what trains: LoRA adapters on a frozen base (peft), the
same on a 4-bit NF4 base (QLoRA, `distft.model.nf4`), or every weight (full finetuning).
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, Qwen3ForCausalLM

from distft.config import Config, ModelConfig
from distft.errors import ConfigError
from distft.hub import hub_offline
from distft.model.lm import causal_lm
from distft.model.nf4 import NF4Spec, quantize_base
from distft.model.presets import DTYPES, PRESETS


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
    projections are 4-bit NF4 (`distft.model.nf4`). Full: every weight trains."""
    if cfg.train.method == "full":
        model.requires_grad_(True)
        return model
    if cfg.train.method == "qlora":  # before PEFT wraps the projections
        quantize_base(causal_lm(model).model.layers, NF4Spec.from_config(cfg.model))

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
