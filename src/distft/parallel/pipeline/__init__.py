"""Pipeline parallelism: the layer stack cut into stages on different ranks (torch.distributed.pipelining).

- `layout.py`: which rank holds which stage and which layers, the schedules, the bubble formula;
- `cost.py`: the modelled cost of a stage, and the cut of the layers that balances the stages;
- `calibrate.py`: the costs a run measured (its timeline), fitted, and the cut they give
  (`distft train --calibrate RUN`; not imported here: it looks strategies up in the registry);
- `stages.py`: a stage's module, this rank's stages and their torch schedule;
- `strategy.py`: `PipelineParallel`, the `pp` strategy (one step, evaluation, gradients, export).

Timing the passes and writing the timeline is measurement: `distft.measure.pipeline`.
"""

from __future__ import annotations

from distft.parallel.pipeline.layout import SCHEDULES, Layout, layout
from distft.parallel.pipeline.strategy import PipelineParallel

__all__ = ["SCHEDULES", "Layout", "PipelineParallel", "layout"]
