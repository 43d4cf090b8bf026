"""Models: the families, the preset table, building or loading a base, the method (LoRA/QLoRA/full), the loss head.

`families` says what each architecture family's decoder layer holds (Qwen3, Llama, Qwen2.5,
Mistral); `presets` is the only architecture table; `build` makes the base and applies the method; `lm` is
the loss head every strategy wraps; `nf4` stores QLoRA's frozen base in 4 bits; `tokens` what
trains beside the adapters (lora.modules_to_save, the rows of model.added_tokens).
"""

from transformers.utils import logging as transformers_logging

from distft.model.build import apply_method, load_base_model, model_config, peft_quietly
from distft.model.lm import LossLM, causal_lm, count_parameters, summed_loss
from distft.model.presets import DTYPES, PRESETS, is_preset, tokenizer_ranks

__all__ = [
    "DTYPES",
    "PRESETS",
    "LossLM",
    "apply_method",
    "causal_lm",
    "count_parameters",
    "is_preset",
    "load_base_model",
    "model_config",
    "peft_quietly",
    "summed_loss",
    "tokenizer_ranks",
]


def _quiet_transformers_bars(factory, args, kwargs):
    """transformers' per-call bars for loading and writing local weights finish in well under a
    second here and print a line each; hub downloads (huggingface_hub's own bars) keep theirs."""
    if kwargs.get("desc") in ("Loading weights", "Writing model shards"):
        kwargs = {**kwargs, "disable": True}
    return factory(*args, **kwargs)


# Installed here, where distft first uses transformers' models (every load and save goes through
# this package), not in `distft/__init__.py`: importing distft stays free of transformers.
if hasattr(transformers_logging, "set_tqdm_hook"):  # transformers 5; older ones keep their bars
    transformers_logging.set_tqdm_hook(_quiet_transformers_bars)
