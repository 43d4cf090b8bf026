"""What a finished run exports, each directory written atomically (`distft.io.files`).

- `DIR/adapter/`: a standard PEFT adapter (adapter_config.json + adapter_model.safetensors) that
  `PeftModel.from_pretrained` loads in a plain Python process, whatever strategy trained it.
- `DIR/model/`: the whole model, for full finetuning (config.json + model.safetensors), with the
  tokenizer and its chat template.
- `DIR/base/`: the randomly initialised base of a preset model, with the tokenizer, so an adapter
  trained on a preset can be loaded anywhere (presets have no weights on the hub).
- `distft export`'s directory: the merged model, tokenizer and model card (`distft.export`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from distft.io.files import atomic_directory
from distft.model.nf4 import QUANTIZATION_FILE


def save_adapter(
    peft_model: nn.Module,
    state: dict[str, torch.Tensor],
    out: Path,
    base_ref: str,
    quantization: dict | None = None,
) -> None:
    """Write `state` (the trained LoRA weights, peft's full names) as a PEFT adapter in `out`.

    A QLoRA adapter also gets `quantization.json` (`distft.model.nf4`): it was trained against the
    NF4-quantized base, which `distft infer` rebuilds (dequantized) before loading it."""
    from peft import get_peft_model_state_dict

    adapter = get_peft_model_state_dict(peft_model, state_dict=state)
    config = peft_model.peft_config["default"]
    config.base_model_name_or_path = base_ref
    with atomic_directory(out) as tmp:
        config.save_pretrained(str(tmp))
        save_file(
            {k: v.contiguous() for k, v in adapter.items()},
            str(tmp / "adapter_model.safetensors"),
            metadata={"format": "pt"},
        )
        if quantization is not None:
            (tmp / QUANTIZATION_FILE).write_text(json.dumps(quantization, indent=1) + "\n")


def save_full_model(
    lm: nn.Module, state: dict[str, torch.Tensor], out: Path, tokenizer: object | None = None
) -> None:
    """Write a fully finetuned model in transformers' layout (tied weights stored once), with the
    tokenizer and its chat template beside it, so `from_pretrained(out)` needs nothing else."""
    with atomic_directory(out) as tmp:
        lm.save_pretrained(str(tmp), state_dict=state)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))


def save_base(lm: nn.Module, tokenizer: object, out: Path) -> None:
    """Write a preset's base model and tokenizer, so its adapter loads outside distft."""
    with atomic_directory(out) as tmp:
        lm.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))


def save_merged_model(lm: nn.Module, tokenizer: object, out: Path, card: str) -> None:
    """Write `distft export`'s output: a plain transformers model (config.json + safetensors), its
    tokenizer with the chat template, and the model card `README.md`."""
    with atomic_directory(out) as tmp:
        lm.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "README.md").write_text(card, encoding="utf-8")
