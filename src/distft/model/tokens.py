"""What trains beside LoRA's adapters: whole modules (`lora.modules_to_save`) and the embedding
rows of the tokens a run adds (`model.added_tokens`). Both are peft's, so the standard adapter
holds them and `PeftModel.from_pretrained` (`distft infer`) and `merge_and_unload` (`distft
export`) need nothing of distft.

- `lora.modules_to_save` (e.g. embed_tokens, lm_head): peft wraps each named module in a
  `ModulesToSaveWrapper`, whose original stays frozen while a copy trains in full and is written
  to adapter_model.safetensors. A tied embedding / lm_head stays one weight (`ensure_weight_tying`):
  naming either trains the one copy both read, as the base shares one weight. A name must be a
  module of the model that holds weights of its own, and neither hold nor be a LoRA target.
- `model.added_tokens`: the tokenizer gets each token its vocabulary lacks, as a special token
  (`distft.data.tokenizer.with_added_tokens`); the embedding, and an untied lm_head, grow to the
  tokenizer's length where they have fewer rows (`fit_vocabulary`; Qwen's checkpoints carry 267
  spare rows past the tokenizer's 151,669 ids, so a few tokens grow nothing there). Under LoRA
  the rows of the listed tokens (one the vocabulary had included) train through peft's
  `trainable_token_indices`: those rows only, of the embedding and of an untied lm_head, a few kB
  in the adapter where a whole embedding copy would be hidden x vocab (and its AdamW state twice
  that). A module named in modules_to_save
  trains whole instead. Full finetuning trains every row anyway.
"""

from __future__ import annotations

import difflib

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from distft.config import Config, lora_target_names
from distft.config.choices import PROJECTION_NAMES
from distft.errors import ConfigError


def weight_holders(model_config: PretrainedConfig, trust_remote_code: bool = False) -> dict[str, set[str]]:
    """Name (last part) of every module holding weights of its own -> the Linear layers it is or
    holds (by their last part), read from the architecture built on the meta device."""
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(model_config, trust_remote_code=trust_remote_code)
    holders: dict[str, set[str]] = {}
    for path, module in lm.named_modules():
        if path and any(True for _ in module.parameters(recurse=False)):
            linears = {
                n.rsplit(".", 1)[-1] for n, m in module.named_modules(prefix=path) if isinstance(m, nn.Linear)
            }
            holders.setdefault(path.rsplit(".", 1)[-1], set()).update(linears)
    return holders


def check_modules_to_save(cfg: Config, model_config: PretrainedConfig) -> None:
    """Refuse, before launch, a `lora.modules_to_save` entry that is no module of the model with
    weights of its own (did-you-mean), one that also gets a LoRA adapter (or, under QLoRA, holds
    a 4-bit projection), or the setting under --method full, which trains every module already."""
    names = cfg.lora.modules_to_save
    if not names:
        return
    if cfg.train.method == "full":
        raise ConfigError(
            "lora.modules_to_save names modules to train in full beside the LoRA adapters, and --method "
            "full trains every module already: drop it, or use --method lora or qlora."
        )
    holders = weight_holders(model_config, cfg.model.trust_remote_code)
    missing = [n for n in names if n not in holders]
    if missing:
        match = difflib.get_close_matches(missing[0], list(holders), n=1, cutoff=0.5)
        hint = f" Did you mean `{match[0]}`?" if match else ""
        raise ConfigError(
            f"`lora.modules_to_save` names {', '.join(missing)}, which {cfg.model.name} does not have: its "
            f"modules with weights are {', '.join(sorted(holders))}.{hint}"
        )
    adapted = set(lora_target_names(cfg.lora.target_modules))
    if cfg.train.method == "qlora":  # every decoder projection is 4-bit, adapted or not
        adapted |= set(PROJECTION_NAMES)
    for name in names:
        if holders[name] & adapted:
            what = (
                "is"
                if holders[name] == {name}
                else f"holds {', '.join(sorted(holders[name] & adapted))}, which is"
            )
            raise ConfigError(
                f"`lora.modules_to_save` names {name}, which {what} trained through a LoRA adapter"
                f"{' on a 4-bit base' if cfg.train.method == 'qlora' else ''}: a module trains either in full "
                "or through its adapter. Drop it from lora.modules_to_save (or from lora.target_modules)."
            )


# ---- added tokens ------------------------------------------------------------------------------


def fit_vocabulary(model: nn.Module, tokenizer, seed: int = 0) -> int:
    """Grow the embedding (and an untied lm_head) of `model`, a transformers causal LM, to the
    tokenizer's length where it has fewer rows; returns the rows added (0: none needed). New rows
    are drawn around the mean of the old ones (transformers' `mean_resizing`), from `seed`, so
    every rank draws the same; what they train to is in the adapter (`trainable_token_indices`),
    the merged export or the full model, never redrawn by `distft infer`."""
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) <= rows:
        return 0
    device = model.get_input_embeddings().weight.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    return len(tokenizer) - rows


def added_token_ids(tokenizer, tokens: list[str]) -> list[int]:
    """The ids of `tokens` in a tokenizer that holds them (`with_added_tokens`), in order, once."""
    ids = tokenizer.convert_tokens_to_ids(list(dict.fromkeys(tokens)))
    assert None not in ids, f"the tokenizer lacks one of {tokens}"
    return ids


def beside_adapters(cfg: Config, model: nn.Module, tokenizer) -> dict:
    """peft `LoraConfig` arguments for what trains beside the adapters of `model` (a causal LM):
    `modules_to_save`, and the rows of the added tokens in the embedding and an untied lm_head
    (`trainable_token_indices`) where that module does not train whole; a tied pair trained whole
    kept one weight (`ensure_weight_tying`). Names go to peft as module paths: peft matches the end of a
    path's text, so `norm` alone would also take every input_layernorm and q_norm."""
    paths = {module: path for path, module in model.named_modules()}
    saved = [path for path, _ in model.named_modules() if path.rsplit(".", 1)[-1] in cfg.lora.modules_to_save]
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    pair = [paths[embed]] if tied else [paths[embed], *([paths[head]] if head is not None else [])]
    whole = set(saved) | (set(pair) if tied and {paths[embed], paths.get(head)} & set(saved) else set())
    rows = {}
    if cfg.model.added_tokens:
        ids = added_token_ids(tokenizer, cfg.model.added_tokens)
        rows = {path: ids for path in pair if path not in whole}
    return {
        "modules_to_save": saved or None,
        "trainable_token_indices": rows or None,
        # Only for a pair trained whole: peft ties a tied pair's trainable rows on its own.
        "ensure_weight_tying": tied and bool(whole & set(pair)),
    }
