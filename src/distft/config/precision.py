"""The precisions the planner is asked about (`distft plan --precision`): bytes per weight,
gradient, master copy, AdamW moment and saved activation, and the `model.dtype` distft runs each
with. Torch-free: the CLI offers their names before importing the planner."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Precision:
    name: str
    param: int  # bytes per element of the weights the model computes with
    grad: int  # bytes per gradient element
    master: int  # fp32 master copy of trainable weights kept for the optimizer (0: none)
    state: int  # bytes per element of each of AdamW's two moments
    activation: int  # bytes per element of saved activations (the compute dtype)
    description: str
    dtype: str = "bfloat16"  # the model.dtype distft runs it with (see `run_line.py`)


PRECISIONS: dict[str, Precision] = {
    "mixed": Precision(
        "mixed", 2, 2, 4, 4, 2, "bf16 weights and gradients, fp32 master weights and AdamW moments"
    ),
    "bf16": Precision("bf16", 2, 2, 0, 4, 2, "bf16 weights and gradients, fp32 AdamW moments, no master"),
    "bf16-pure": Precision(
        "bf16-pure", 2, 2, 0, 2, 2, "all bf16 (distft with model.dtype=bfloat16: AdamW moments in bf16)"
    ),
    "fp32": Precision("fp32", 4, 4, 0, 4, 4, "all fp32 (distft's CPU default)", "float32"),
}
