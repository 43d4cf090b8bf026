"""Float8 training of the decoder's Linear layers (`model.fp8`): torchao's rowwise recipe.

`convert_to_float8(model, mode)` swaps Linear layers of the decoder for torchao's `Float8Linear`
(`convert_to_float8_training`, `Float8LinearConfig.from_recipe_name("rowwise")`). Each matmul
then runs on the float8 tensor cores: the input is scaled per row (one scale per token) and the
weight per output row, both cast to e4m3, and `torch._scaled_mm` multiplies them, applies the two
scale vectors and writes bf16. Backward does the same for the gradient's matmuls: the output
gradient is cast to e4m3 with per-row scales, and both dX = dY W and dW = dY^T X run in float8.
The scales are powers of two (the recipe rounds them down): applying them is exact.
The weights stay bf16 parameters, the scales are recomputed from them every step (dynamic
scaling, no history to keep or checkpoint), and a `Float8Linear` is an `nn.Linear`: its
parameter names, the state dict and the exported adapter are what they were.

- `base` (--method lora): only the frozen projections under peft's adapters, the modules named
  `*.base_layer` (peft's `lora.Linear.base_layer`). The adapters (`lora_A`, `lora_B`), the norms,
  the embedding and `lm_head` keep their dtype and their bf16/fp32 matmuls: the adapters are
  small and what trains; the head's logits feed the loss directly.
- `all` (--method full): every Linear of the decoder layers; the embedding and `lm_head` are not.

A layer is converted only where both its dimensions are multiples of 16 (`ALIGNMENT`):
`_scaled_mm` (cuBLASLt's float8 GEMM) takes only operands whose inner and outer dimensions are
16-aligned. Every real model's projections are; another Linear stays as it was. The token count is
a matmul's inner dimension in dW = dY^T X and packed rows have any length, so the config pads
that dimension with zeros (`pad_inner_dim`). torchao's backward computes dW even for a frozen
weight; compiled (`distft.model.compile`, per decoder layer after this conversion: `Float8Linear`
is written to be compiled, its casts fused into a few kernels) that unused matmul is dead code
and dropped (tests/model/test_fp8.py counts the matmuls), eager it runs and is thrown away.

Float8 matmuls need a CUDA GPU of compute capability 8.9 or newer (`FP8_CAPABILITY`: Ada and
Hopper). `fp8_hardware_refusal` says why a run cannot have them (the CPU, an older GPU), checked
before launch and again in each rank; on the CPU torch emulates `_scaled_mm`, which is how the
tests run the conversion.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from distft.errors import ConfigError
from distft.model.lm import causal_lm

ALIGNMENT = 16  # _scaled_mm: both dimensions of a float8 operand are multiples of 16
FP8_CAPABILITY = (8, 9)  # Ada (sm89) and Hopper (sm90): float8 tensor cores
FP8_GPUS = "H100, H200, L40S, L4, RTX 4090"
Gpu = tuple[int, str, tuple[int, int]]  # index, name, compute capability


def float8_candidate(module: nn.Module, name: str, mode: str) -> bool:
    """Whether `mode` turns this Linear of a decoder layer (its name inside the layers) to float8:
    a plain Linear (not one already converted, nor an NF4 one), 16-aligned, and under `base` a
    frozen base under peft's adapters."""
    if type(module) is not nn.Linear:
        return False
    if module.in_features % ALIGNMENT or module.out_features % ALIGNMENT:
        return False
    return mode == "all" or name.endswith(".base_layer")


def convert_to_float8(model: nn.Module, mode: str) -> int:
    """Swap the decoder layers' Linear layers `mode` names (base, all) for torchao's rowwise
    `Float8Linear`, in place; how many were swapped (off: none)."""
    return 0 if mode == "off" else convert_layers(causal_lm(model).model.layers, mode)


def convert_layers(layers: nn.Module, mode: str) -> int:
    """`convert_to_float8` on the modules under `layers` (names relative to it)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), pad_inner_dim=True)
    converted: list[str] = []

    def wanted(module: nn.Module, name: str) -> bool:
        if float8_candidate(module, name, mode):
            converted.append(name)
            return True
        return False

    convert_to_float8_training(layers, module_filter_fn=wanted, config=config)
    return len(converted)


def fp8_hardware_refusal(mode: str, device_type: str, gpus: list[Gpu]) -> str | None:
    """Why `model.fp8=mode` cannot run on this device (cpu, or cuda with these GPUs), or None."""
    if mode == "off":
        return None
    if device_type != "cuda":
        return (
            f"model.fp8={mode} needs a CUDA GPU of compute capability 8.9 or newer ({FP8_GPUS}): "
            f"this run is on the {device_type.upper()}, which has no float8 matmul kernels. "
            "Set model.fp8=off, or run on such a GPU."
        )
    old = [(i, name, cap) for i, name, cap in gpus if tuple(cap) < FP8_CAPABILITY]
    if not old:
        return None
    named = ", ".join(f"GPU {i} ({name}, compute capability {cap[0]}.{cap[1]})" for i, name, cap in old)
    return (
        f"model.fp8={mode} needs float8 tensor cores, compute capability 8.9 or newer ({FP8_GPUS}), "
        f"but {named} {'is' if len(old) == 1 else 'are'} older. Set model.fp8=off (bf16 matmuls), "
        "or run on such a GPU."
    )


def check_fp8_hardware(mode: str, device: torch.device | str, nproc: int = 1) -> None:
    """`fp8_hardware_refusal` for `device`: a rank's own GPU (cuda:N), the first `nproc` GPUs of
    this node (cuda), or the CPU. ConfigError when refused."""
    if mode == "off":
        return
    device = torch.device(device)
    gpus: list[Gpu] = []
    if device.type == "cuda":
        indices = [device.index] if device.index is not None else range(nproc)
        gpus = [
            (i, torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
            for i in indices
            if i < torch.cuda.device_count()
        ]
    if refusal := fp8_hardware_refusal(mode, device.type, gpus):
        raise ConfigError(refusal)
