"""Megatron-style tensor parallelism with sequence parallelism (`tp-sp`), by hand, LoRA built in.

Laid out like picotron's `tensor_parallel/`, read in this order:
- `collectives.py`: the autograd collectives, f / g (plain TP) and all-gather / reduce-scatter
  along the sequence (SP), each forward paired with its adjoint in backward;
- `layers.py`: what is sharded, `ColumnParallelLinear` / `RowParallelLinear` holding one rank's
  slice of a projection and of its LoRA adapter (no collective inside);
- `model.py`: the Qwen3 forward, sequence-first, with a block's collectives at its entry and exit:
  per layer 2 all-gathers + 2 reduce-scatters forward and again backward (SP), or 2 all-reduces
  each way (plain TP);
- `strategy.py`: `TensorSequenceParallel`, which shards the model, sums the partial gradients after
  backward (one flat all-reduce), and presents the shards to checkpoints and the export.

Papers: Shoeybi et al., "Megatron-LM" (1909.08053); Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models" (2205.05198).
"""

from __future__ import annotations

from distft.parallel.megatron.layers import PLAN
from distft.parallel.megatron.strategy import TensorSequenceParallel

__all__ = ["PLAN", "TensorSequenceParallel"]
