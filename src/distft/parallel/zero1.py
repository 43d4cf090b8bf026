"""ZeRO-1 (`zero1`): DDP's gradient all-reduce, with AdamW's state sharded over the ranks.

What each rank holds: the whole model and the whole (all-reduced) gradient of every trainable
parameter, as under DDP, but the AdamW state (two moments and a step counter) of its own partition
of the trainable tensors only. The partition is by whole tensors, largest first, each to the rank
with the fewest elements so far (`torch.distributed.optim.ZeroRedundancyOptimizer`), so every rank
holds about 1/N of the optimizer state: the largest part of full finetuning's memory (12 of 16 bytes
per parameter under mixed precision), and the part that grows with the optimizer, not the batch.

Which collectives run, and when (per optimizer step, N ranks, G = the trainable gradients' bytes,
W = the trainable weights' bytes, equal to G in one dtype):
- backward of the last micro-batch: DDP's bucketed all-reduce of the gradients, overlapping
  backward, exactly as `ddp` (`parallel/ddp.py`: the other micro-batches run under `no_sync()`).
  Logical bytes G; 2 (N-1)/N G on the wire of each rank (ring);
- the optimizer step: each rank runs AdamW on its partition alone, then every rank broadcasts its
  updated weights, flattened into one bucket (`parameters_as_bucket_view`), to the others: N
  broadcasts, together an all-gather of the updated weights. Every rank takes part in every one, so
  the logical bytes are W per rank, in N calls; a rank sends its W/N and receives (N-1)/N W.
  They do not overlap anything: the next forward needs the weights.
So ZeRO-1 moves G + W where DDP moves G, for 1/N of the optimizer state. (DeepSpeed's ZeRO-1
reduce-scatters the gradients instead, (N-1)/N G on the wire, since a rank updates only its
partition; torch's version keeps DDP unchanged and pays the full all-reduce.) The gradient norm
is computed locally: every rank holds the same whole gradients.

Checkpoints: each rank writes the AdamW state of its partition under the parameters' own names
(`state.<fqn>.exp_avg`, ...), the names a DDP or single-process checkpoint uses. DCP stores the
union, so a resume at any world size (or as `ddp` or `single`) reads each parameter's state from
wherever it was written; a rank loads only the names its new partition holds.

Paper: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(1910.02054), stage 1 ("P_os").
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from distft.errors import ConfigError
from distft.parallel.ddp import DDP


class ZeRO1(DDP):
    name = "zero1"

    def build_optimizer(
        self,
        params: list[nn.Parameter] | list[dict],
        optimizer_class: type[torch.optim.Optimizer],
        **defaults,
    ) -> torch.optim.Optimizer:
        # Param groups (LoRA+) partition like plain tensors: each rank's optimizer gets its share of each group.
        tensors = [p for g in params for p in g["params"]] if isinstance(params[0], dict) else params
        dtypes = {p.dtype for p in tensors}
        if len(dtypes) > 1:  # one flat bucket per rank holds them: ZeroRedundancyOptimizer refuses
            raise ConfigError(
                f"--strategy zero1 needs every trainable tensor in one dtype; this model trains "
                f"{', '.join(sorted(map(str, dtypes)))}. Use --strategy ddp or fsdp, or one model.dtype."
            )
        return ZeroRedundancyOptimizer(
            params,
            optimizer_class=optimizer_class,
            # Each rank's partition lives in one flat tensor: one broadcast per rank, not one per tensor.
            parameters_as_bucket_view=True,
            **defaults,
        )

    def local_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer.optim  # the AdamW over this rank's partition

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        # ZeroRedundancyOptimizer.state_dict() first gathers every partition on one rank; DCP needs
        # none of that: each rank hands over its own AdamW, whose parameters have their usual names.
        # The scheduler sets the wrapper's learning rate, which reaches the local AdamW only at its
        # next step: copy it now, or the checkpoint would hold the learning rate of the last step.
        local = self.local_optimizer(optimizer)
        copy_hyperparameters(optimizer.param_groups, local.param_groups)
        return super().checkpoint_state(model, local)

    def load_checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        local = self.local_optimizer(optimizer)
        super().load_checkpoint_state(model, local, state)
        # The wrapper copies its groups into the local AdamW before every step: give it the
        # restored ones, or the first resumed step would run at a fresh scheduler's learning rate.
        copy_hyperparameters(local.param_groups, optimizer.param_groups)


def copy_hyperparameters(source: list[dict], target: list[dict]) -> None:
    """Learning rate, betas, ... of each param group of `source` into the same group of `target`."""
    for src, dst in zip(source, target, strict=True):
        dst.update({k: v for k, v in src.items() if k != "params"})
