"""2D parallelism (`ddp+pp`): data parallelism across replicas of a pipeline.

The ranks form a ("pp", "dp") `DeviceMesh` (`distft.layout.ParallelDims`, pp outermost):
with dp = pp = 2, ranks {0, 2} are pipeline replica 0 and {1, 3} replica 1; {0, 1} and {2, 3}
are the data-parallel groups of pipeline ranks 0 and 1. Each replica is exactly the `pp`
strategy (`PipelineParallel`: the same stages, schedules, loss and timeline) over its column of
the mesh, and reads its own 1/dp of the global batch; the mesh, its columns and the checks of
the degrees are `pipeline/replicas.py`'s (`MeshPipeline`, shared with fsdp+pp and fsdp+tp+pp).

What each rank holds: the stage(s) its pipeline rank holds under `pp` (decoder layers, the
embedding on the first stage, norm + lm_head + loss on the last), their gradients and AdamW
state, whole (nothing is sharded across dp); the activations of its replica's micro-batches.

What runs on which mesh dimension, per optimizer step:
- pp (inside a replica): the schedule's send/recv of one (mb, seq, hidden) activation per
  micro-batch per stage boundary forward and of its gradient backward; the gradient norm's float64
  sum of squares (every stage's share, once: the replicas hold equal gradients after the dp
  all-reduce, so summing over dp too would count each dp times); full finetuning of a tied
  embedding: the sum of the two copies' gradients, between the first and the last stage's ranks;
- dp (same pipeline rank, different replicas): one all-reduce of this rank's trainable stage
  gradients, flattened into one buffer, after the schedule;
- all ranks: the loss sum (only last stages have one; the sum over the world is the global batch's).

Why one flat all-reduce after the schedule (`grads.all_reduce_flat`) and not DDP around the stage
module: each replica's gradient is already d(its token-loss sum / the global label-token count)
(`scale_grads=False`), so the SUM over dp is exactly the single-process gradient; and DDP's hooks
follow neither zero-bubble's split backward nor several stages per rank (docs/2d.md).

Batch accounting: `data_parallel_size` is dp, a rank's data shard its dp coordinate; the layout
cuts global_batch_size / dp sequences into the schedule's micro-batches.
"""

from __future__ import annotations

from torch import nn

from distft.parallel.grads import all_reduce_flat
from distft.parallel.pipeline.replicas import MeshPipeline


class DDPPipelineParallel(MeshPipeline):
    name = "ddp+pp"

    def after_backward(self, model: nn.Module) -> None:
        super().after_backward(model)  # a tied embedding's two copies, inside the pipeline
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        all_reduce_flat(grads, group=self.dp_group)  # one SUM over dp: see the module docstring
