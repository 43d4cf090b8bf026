"""Compiled decoder blocks: `torch.compile` per Qwen3 decoder layer, as torchtitan and torchtune do.

Compiling each block rather than the whole model keeps compile time to one block's graph (every
layer has the same shapes, so the compiled code is reused), leaves the embeddings, the loss head
and the optimizer eager, and lets FSDP wrap each compiled block as its own sharding unit: blocks
are compiled *before* the strategy wraps them. The LoRA adapters (peft's `lora_A`/`lora_B`) sit
inside the blocks and are compiled with them.

`Module.compile()` compiles in place: the module tree, parameter names, state dicts and the
exported adapter stay exactly those of the eager model (`torch.compile(module)` would add an
`_orig_mod.` level to every name).

`model.compile`: `auto` (on for CUDA where the strategy takes compiled blocks, off on the CPU, where
inductor's C++ code buys little and costs minutes of compile time), `true`, `false`. Strategies
that rewrite the blocks themselves (TP's DTensor plans, tp-sp's hand-written layers, pipeline
stages) say so with `supports_compile = False`; `true` is refused for them before launch.
"""

from __future__ import annotations

import torch
from torch import nn

from distft.model.lm import causal_lm

COMPILE_CHOICES = ("auto", "true", "false")


def compile_wanted(setting: str, device: torch.device, strategy_supports: bool) -> bool:
    """Whether to compile the decoder blocks: `true`, or `auto` on CUDA, where the strategy can."""
    if setting == "true":
        return True
    return setting == "auto" and device.type == "cuda" and strategy_supports


def compile_blocks(model: nn.Module) -> int:
    """Compile every decoder layer of `model` (a causal LM, PEFT-wrapped or not) in place;
    returns how many. Compilation itself happens on each block's first forward."""
    layers = causal_lm(model).model.layers
    for layer in layers:
        layer.compile()
    return len(layers)
