"""Models: the families, the preset table, building or loading a base, the method (LoRA/QLoRA/full), the loss head.

`families` says what each architecture family's decoder layer holds (Qwen3, Llama, Qwen2.5,
Mistral); `presets` is the only architecture table; `build` makes the base and applies the method; `lm` is
the loss head every strategy wraps; `nf4` stores QLoRA's frozen base in 4 bits.
"""

from distft.model.build import apply_method, load_base_model, model_config, peft_quietly
from distft.model.lm import LossLM, causal_lm, count_parameters, summed_loss
from distft.model.presets import DTYPES, PRESETS, QWEN3_VOCAB, Preset, is_preset

__all__ = [
    "DTYPES",
    "PRESETS",
    "QWEN3_VOCAB",
    "LossLM",
    "Preset",
    "apply_method",
    "causal_lm",
    "count_parameters",
    "is_preset",
    "load_base_model",
    "model_config",
    "peft_quietly",
    "summed_loss",
]
