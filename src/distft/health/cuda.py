"""What this node's GPUs can run, checked before launch: bfloat16 needs compute capability 8.0.

Ampere (A100, A10, RTX 30xx; capability 8.x) and newer compute in bfloat16 natively. Older cards
(V100 7.0, T4 7.5, P100 6.0) do not: torch emulates it, many times slower, or a kernel fails deep
in the first step. distft asks for bfloat16 in two places, `model.dtype=bfloat16` (the base's
weights) and `model.autocast=true` (forward and backward under bf16 autocast on CUDA, the
default), so a run that would use it on an older GPU is refused before any process starts.
"""

from __future__ import annotations

import torch

from distft.config import ModelConfig
from distft.errors import ConfigError

BF16_CAPABILITY = (8, 0)


def bf16_refusal(dtype: str, autocast: bool, gpus: list[tuple[int, str, tuple[int, int]]]) -> str | None:
    """The refusal for a run asking for bfloat16 on GPUs (index, name, capability) below 8.0, or None."""
    wanted = [
        w
        for w, on in (("model.dtype=bfloat16", dtype == "bfloat16"), ("model.autocast=true", autocast))
        if on
    ]
    old = [(i, name, cap) for i, name, cap in gpus if cap < BF16_CAPABILITY]
    if not wanted or not old:
        return None
    named = ", ".join(f"GPU {i} ({name}, compute capability {cap[0]}.{cap[1]})" for i, name, cap in old)
    return (
        f"{' and '.join(wanted)} ask{'s' if len(wanted) == 1 else ''} for bfloat16, which needs compute "
        f"capability 8.0 or newer (A100, A10, L4, H100, RTX 30xx and later), but {named} "
        f"{'is' if len(old) == 1 else 'are'} older: bfloat16 would be emulated, many times slower, or fail "
        "in the first step. Set model.dtype=float32 and model.autocast=false (distft has no float16 mode), "
        "or run on a newer GPU."
    )


def check_bf16(model: ModelConfig, nproc: int) -> None:
    """`bf16_refusal` for the GPUs this node's `nproc` ranks take (0..nproc-1); call it on CUDA only."""
    count = torch.cuda.device_count()
    gpus = [
        (i, torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
        for i in range(min(nproc, count))
    ]
    refusal = bf16_refusal(model.dtype, model.autocast, gpus)
    if refusal:
        raise ConfigError(refusal)
