"""Loss parity with the plain loop: the GPU run's correctness gate.

A fast run proves nothing until it trains what a plain loop trains. `distft bench --gpu` therefore
runs distft's LoRA once more at the plain loop's own settings (`plain_settings`: its learning rate,
constant, no warm-up, no weight decay, clip 1.0) and compares the two loss curves step by step. Both
start from the same weights (the preset drawn under the seed, LoRA's A drawn under it again: distft
seeds both; `distft.bench.plain.build_model` does the same), read the same rows in the same seeded
global batches and count a global batch's loss the same way (summed token losses over its labelled
tokens). What differs is the machinery: compiled blocks, FlexAttention or SDPA on a packed row,
the loss head on the labelled positions only, fused AdamW, autocast. So the curves agree to
rounding, or something in that machinery trains wrong.

The tolerance is the largest relative difference of the per-step losses: 1e-4 in float32 (on the
CPU the test suite holds `micro` to it) and 2e-2 in bfloat16, whose 8-bit mantissa rounds every
matmul's output to 0.4% and whose rounding differs between a compiled and an eager kernel, then
compounds through the steps.
"""

from __future__ import annotations

PLAIN_LR = 1e-4  # the plain loop's learning rate (a user's LoRA default)
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}  # largest relative difference per step


def plain_settings(seed: int) -> list[str]:
    """`distft train` overrides that train as the plain loop does (`distft.bench.plain`)."""
    return [
        f"optim.lr={PLAIN_LR:g}",
        "optim.scheduler=constant",
        "optim.warmup_steps=0",
        "optim.weight_decay=0",
        "optim.grad_clip=1.0",
        f"model.seed={seed}",
        "moe.aux_loss_coef=0",  # a mixture of experts: the plain loop adds no router loss
    ]


def compare(distft: list[float], plain: list[float], dtype: str) -> dict:
    """Both curves, their largest relative difference (to the plain loop's loss) and the verdict."""
    if len(distft) != len(plain) or not distft:
        raise ValueError(f"loss curves of {len(distft)} and {len(plain)} steps: nothing to compare")
    worst = max(abs(a - b) / abs(b) for a, b in zip(distft, plain, strict=True))
    tolerance = TOLERANCE[dtype]
    return {
        "distft": distft,
        "plain": plain,
        "max_relative_difference": worst,
        "tolerance": tolerance,
        "within": worst <= tolerance,
        "lr": PLAIN_LR,
    }
