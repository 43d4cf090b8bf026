"""What a run saves, each directory written atomically (`distft.io.files`).

- `DIR/adapter/`: a standard PEFT adapter (adapter_config.json + adapter_model.safetensors) that
  `PeftModel.from_pretrained` loads in a plain Python process, whatever strategy trained it.
- `DIR/model/`: the whole model, for full finetuning (config.json + model.safetensors), with the
  tokenizer and its chat template.
- `DIR/base/`: a preset model's base: its recipe (preset, seed, dtype, device type) and the
  tokenizer, plus its random weights for the small CPU presets, so their adapters load anywhere
  with plain peft. A real-size preset's base (8 GB for Qwen3-4B) is never written: the recipe
  rebuilds it bit for bit (`distft.model.build.rebuild_base`).
- `distft export`'s directory: the merged model, tokenizer and model card (the command is
  `distft.export`; its directory is written here, `save_merged_model`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from distft.config import Config
from distft.data.tokenizer import save_tokenizer
from distft.io.files import atomic_directory
from distft.io.lineage import write_lineage
from distft.model.build import RECIPE_FILE
from distft.model.nf4 import QUANTIZATION_FILE
from distft.model.presets import PRESETS


def save_adapter(
    peft_model: nn.Module,
    state: dict[str, torch.Tensor],
    out: Path,
    base_ref: str,
    quantization: dict | None = None,
    tokenizer: object | None = None,
) -> None:
    """Write `state` (the trained LoRA weights, peft's full names, with what trains beside them:
    `distft.model.tokens`) as a PEFT adapter in `out`; with `tokenizer` (a run that changed the
    base's: data.chat_template, model.added_tokens), that tokenizer beside it, so the adapter alone
    carries what it was trained with.

    A QLoRA adapter also gets `quantization.json` (`distft.model.nf4`): it was trained against the
    NF4-quantized base, which `distft infer` rebuilds (dequantized) before loading it."""
    from peft import get_peft_model_state_dict

    # The embeddings are saved where they train (lora.modules_to_save, the rows of added tokens:
    # `distft.model.tokens`), never whole because the vocabulary grew ("auto" would also ask the
    # hub for the base's config.json).
    adapter = get_peft_model_state_dict(
        peft_model, state_dict=tied_names(peft_model, state), save_embedding_layers=False
    )
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
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)


def tied_names(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` under every name of each of its parameters. A tied embedding / lm_head trained beside
    the adapters (`distft.model.tokens`) is one parameter, named once by `named_parameters()`, and
    peft saves it under each module that holds it (a copy each, as peft's own `save_pretrained`)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    out = dict(state)
    for aliases in names.values():
        known = next((n for n in aliases if n in state), None)
        if known is not None:  # a copy each: safetensors writes no tensors that share storage
            out.update({n: state[known].clone() for n in aliases if n != known})
    return out


def save_full_model(
    lm: nn.Module,
    state: dict[str, torch.Tensor],
    out: Path,
    tokenizer: object | None = None,
    lineage: dict | None = None,
) -> None:
    """Write a fully finetuned model in transformers' layout (tied weights stored once), with the
    tokenizer and its chat template beside it, so `from_pretrained(out)` needs nothing else; a
    preset's descendant also gets its `lineage.json` (`distft.io.lineage`), which a run that trains
    on this directory (`--model DIR/model`) carries on."""
    with atomic_directory(out) as tmp:
        lm.save_pretrained(str(tmp), state_dict=state)
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)
        write_lineage(tmp, lineage)


def base_weights_written(cfg: Config) -> bool:
    """Whether a run writes its base's weights to DIR/base: a small preset with output.save_base
    (a real-size preset, one mirroring a released model, is written as its recipe alone)."""
    return cfg.model.name in PRESETS and cfg.output.save_base and not PRESETS[cfg.model.name].hub_id


def save_base(lm: nn.Module, tokenizer: object, out: Path, recipe: dict, weights: bool) -> None:
    """Write a preset's base to `out`: its recipe (`distft.model.build.base_recipe`) and tokenizer
    always, its random weights only when `weights` (small presets), so its adapter loads outside
    distft. A real-size preset's base is the recipe alone: `distft infer` rebuilds it."""
    with atomic_directory(out) as tmp:
        if weights:
            lm.save_pretrained(str(tmp))
        save_tokenizer(tokenizer, tmp)
        (tmp / RECIPE_FILE).write_text(json.dumps(recipe, indent=1) + "\n")


def save_merged_model(
    lm: nn.Module, tokenizer: object, out: Path, card: str, lineage: dict | None = None
) -> None:
    """Write `distft export`'s output: a plain transformers model (config.json + safetensors), its
    tokenizer with the chat template, the model card `README.md`, and a preset descendant's
    `lineage.json` (so a run on the export still says it started random)."""
    with atomic_directory(out) as tmp:
        lm.save_pretrained(str(tmp))
        save_tokenizer(tokenizer, tmp)
        (tmp / "README.md").write_text(card, encoding="utf-8")
        write_lineage(tmp, lineage)
