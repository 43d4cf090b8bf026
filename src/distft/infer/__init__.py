"""Inference and evaluation with a trained run: load base + adapter, summarise, score.

`load` loads a run (or a bare adapter) the way a user would by hand, `generate` turns transcripts
into summaries (greedy or sampled), `evaluate` scores base against finetuned, and `commands` holds
the `distft infer` and `distft eval` command lines. docs/serving.md serves the same adapter with vLLM.
"""

from distft.infer.commands import cmd_eval, cmd_infer
from distft.infer.evaluate import validation_loss
from distft.infer.generate import Generated, Sampling, generate
from distft.infer.load import Loaded, load_trained, preset_notice

__all__ = [
    "Generated",
    "Loaded",
    "Sampling",
    "cmd_eval",
    "cmd_infer",
    "generate",
    "load_trained",
    "preset_notice",
    "validation_loss",
]
