"""The optimizer state one rank keeps for a trained tensor, as each `optim.name` keeps it, and
ZeRO-1's partition of whole tensors among the ranks.

- adamw (torch's): two moments per element in the state dtype, an fp32 master copy where mixed
  precision keeps one, and `step`, one fp32 scalar tensor.
- adamw-8bit (bitsandbytes' `AdamW8bit`): a tensor of 4096 elements or more keeps each moment in
  1 byte, block-quantized, with one fp32 absmax per moment and block of 256 elements; a smaller
  tensor keeps fp32 moments. The quantized tensors share two 256-entry fp32 code books (`qmap`),
  once per optimizer. No master copy (it updates the weight in its own dtype), and `step` is a
  Python int.
- sgd (torch's): one momentum buffer in the weight's dtype (none at `optim.momentum` 0), no step.
"""

from __future__ import annotations

import math

from distft.plan.inputs import Training

STEP_BYTES = 4  # torch AdamW's `step`: one fp32 scalar tensor per trained tensor
BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes' `min_8bit_size`: smaller tensors keep fp32 moments
BNB_BLOCK = 256  # elements per absmax
BNB_CODE = 256  # entries of each moment's code book


def optimizer_state_bytes(numel: int, moment: int, master: int, training: Training) -> int:
    """Bytes of one trained tensor's state over its `numel` local elements; `moment` and `master`:
    bytes per element of one AdamW moment and of the master copy (`memory.trained_element_bytes`)."""
    if training.optimizer == "adamw-8bit":
        if numel < BNB_MIN_8BIT_SIZE:
            return 2 * 4 * numel
        return 2 * (numel + 4 * math.ceil(numel / BNB_BLOCK))
    if training.optimizer == "sgd":
        return (moment + master) * numel if training.sgd_momentum else 0
    return (2 * moment + master) * numel + STEP_BYTES


def shared_state_bytes(numels: list[int], training: Training) -> int:
    """State one optimizer keeps once for the tensors of `numels` (local elements): AdamW8bit's
    two code books, where any of them is quantized."""
    quantized = training.optimizer == "adamw-8bit" and any(n >= BNB_MIN_8BIT_SIZE for n in numels)
    return 2 * 4 * BNB_CODE if quantized else 0


def zero1_partition(numels: list[int], n: int) -> list[int]:
    """The rank whose optimizer holds each tensor's state under torch's ZeroRedundancyOptimizer:
    tensors largest first (ties in their order), each to the rank with the fewest elements so far
    (the lowest such rank)."""
    owners, sizes = [0] * len(numels), [0] * n
    for i in sorted(range(len(numels)), key=lambda i: numels[i], reverse=True):
        owners[i] = sizes.index(min(sizes))
        sizes[owners[i]] += numels[i]
    return owners
