"""QLoRA's projections: a linear on an NF4 weight whose dequantisation is one fused kernel on CUDA.

Every forward and every backward of a QLoRA projection first rebuilds its weight in the model
dtype from the 4-bit codes (`distft.model.nf4`), then multiplies. torchao's own path
(`F.linear` on an NF4Tensor -> `LinearNF4` -> `get_original_weight`) does that in eager PyTorch:
about a dozen kernels per weight, two of them writing the codes out as int64 (8 bytes per 4-bit
code, 16x the weight's own storage) before two gathers, a stack and a copy. On a GPU that is
memory traffic several times the bf16 weight, twice per projection per micro-batch, and it is
what halves QLoRA's throughput next to LoRA's in eager mode.

`dequantize` is the same arithmetic written on the NF4Tensor's plain inner tensors (codes, int8
block scales, group factors, mean, code book). Eager, it is bit for bit torchao's
`get_original_weight`. `torch.compile`d (`compiled_dequantize`), inductor fuses it into one
kernel that reads the 0.5 bytes per weight of codes and the scales and writes the weight once:
the extra traffic becomes ~2.5 bytes per weight, against the matmul's 2 FLOPs x tokens per
weight. Compiling a plain function of plain tensors needs no tensor-subclass tracing, so it
works whether or not the decoder blocks are compiled (`distft.model.compile`); inside a compiled
block dynamo inlines it into the block's graph, which traces whole (no graph break).

`NF4Linear` is `nn.Linear` with that forward: `quantize_base` turns each projection into one by
class (names, parameters and state dicts unchanged; peft wraps it as any `nn.Linear`).
`use_compiled_dequantize` picks the compiled dequantisation by `model.compile`: `auto` on CUDA,
`true` everywhere, `false` never; with `false` the eager path is torchao's arithmetic exactly.
Compiled, fp32 weights are bitwise the eager ones; bf16 ones may differ by one unit in the last
place, since inductor computes the scale in fp32 and rounds once.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


def dequantize_parts(
    codes: torch.Tensor,  # uint8, two 4-bit codes per byte (first in the high nibble)
    scalers: torch.Tensor,  # int8 block absmaxes minus their mean (double quant) or model-dtype ones
    factors: torch.Tensor,  # one scale per group of `group` block absmaxes
    mean: torch.Tensor,  # the mean subtracted from the absmaxes
    book: torch.Tensor,  # the 16 NF4 levels
    block_size: int,
    group: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The weight as a flat (n/2, 2) tensor in `dtype`: torchao's `get_original_weight`, op for op."""
    first = book[(codes >> 4).to(torch.long)]
    second = book[(codes & 0b1111).to(torch.long)]
    groups = scalers.numel() // group
    absmax = (scalers.view(groups, group) / factors.unsqueeze(-1)).flatten().to(dtype) + mean
    repeated = absmax.unsqueeze(-1).expand(absmax.size(0), block_size // 2).flatten()
    return torch.stack([first * repeated, second * repeated], dim=-1)


@functools.cache
def compiled_dequantize():
    """`dequantize_parts` under torch.compile (one kernel per weight shape; compiled on first use)."""
    return torch.compile(dequantize_parts, fullgraph=True)


def dequantize(weight: torch.Tensor, compiled: bool = False) -> torch.Tensor:
    """An NF4Tensor as a plain tensor of its shape and outer dtype."""
    # Inside a compiled block, dynamo traces the plain function into the block's own graph.
    fn = compiled_dequantize() if compiled and not torch.compiler.is_compiling() else dequantize_parts
    flat = fn(
        weight.quantized_data,
        weight.quantized_scalers,
        weight.quantization_factor,
        weight.scaler_mean,
        weight.nf4,
        weight.block_size,
        weight.scaler_block_size,
        weight.dtype,
    )
    return flat.reshape(weight.shape)


class NF4LinearFunction(torch.autograd.Function):
    """y = x W^T with W dequantized in the forward and again in the backward (never kept: the
    4-bit codes are what stays in memory). W is frozen, so only x gets a gradient, as in torchao's
    `LinearNF4`, whose casts this follows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, compiled: bool) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.compiled = compiled
        return F.linear(x, dequantize(weight, compiled).to(x.dtype))

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return grad_output @ dequantize(weight, ctx.compiled).to(grad_output.dtype), None, None


def _is_nf4_tensor(t: torch.Tensor) -> bool:
    return "NF4Tensor" in type(t).__name__ and hasattr(t, "quantized_data")


class NF4Linear(nn.Linear):
    """A projection whose weight is an NF4Tensor (`quantize_base` sets the class in place)."""

    compiled_dequantize: bool = False  # set per module by `use_compiled_dequantize`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not _is_nf4_tensor(weight):  # dequantized for inference (`dequantize_base`), or a plain load
            return super().forward(x)
        out = NF4LinearFunction.apply(x, weight, self.compiled_dequantize)
        return out if self.bias is None else out + self.bias


def dequantize_compiled_wanted(setting: str, device: torch.device) -> bool:
    """`model.compile` for the NF4 dequantisation: `true`, or `auto` on CUDA. Every strategy can
    take it: it compiles a function of plain tensors, below anything a strategy rewrites."""
    return setting == "true" or (setting == "auto" and device.type == "cuda")


def use_compiled_dequantize(model: nn.Module, compiled: bool) -> int:
    """Set every `NF4Linear` in `model` to the compiled (or eager) dequantisation; how many."""
    linears = [m for m in model.modules() if isinstance(m, NF4Linear)]
    for m in linears:
        m.compiled_dequantize = compiled
    return len(linears)
