"""What the loop measures around each step, beyond loss and time: one object, called once a step.

- Collectives, every step (`distft.measure.overlap.CommTimeline`, a `CommCounter` with timestamps):
  bytes and calls per kind (and per mesh dimension, where several process groups ran), the time
  communication ran, the part of it no compute hid, and the overlap fraction. The first step's
  bytes are recorded beside the bytes formula's for that step (`expected_bytes`: the planner's,
  `distft.plan.expected`); later steps show the steady state (DDP rebuilds its buckets after its
  first synced backward).
- Saved activations (`distft.measure.activations.SavedActivations`) of the first step's first
  micro-batch, beside the activation model's bytes for it (`expected_saved`).
- A pipeline's timeline of every step (`distft.measure.pipeline.PipelineTimeline`): idle fractions
  and stage imbalance, measured and modelled, and `DIR/pipeline_timeline.json`; its modelled cut
  also goes to the header (`header_lines`) and ranks.json (`rank_record`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from torch import nn

from distft.measure.activations import SavedActivations
from distft.measure.overlap import CommTimeline
from distft.measure.pipeline import PipelineTimeline, cut_lines
from distft.parallel import Strategy
from distft.parallel.pipeline import PipelineParallel


class StepMeasurements:
    """`watch(step)` around a step's work, then `report(step, examples)` for its record.

    `expected_bytes(examples)`: the bytes a step over those examples should move, per kind and
    per mesh dimension (or None), or None where no formula models the run; `expected_saved(examples)`:
    the bytes its first micro-batch should keep for backward on this rank, or None.
    """

    def __init__(
        self,
        strategy: Strategy,
        model: nn.Module,
        first_step: int,
        expected: tuple[Callable, Callable],
        out: Path,
    ):
        self.strategy, self.model, self.first_step = strategy, model, first_step
        self.expected_bytes, self.expected_saved = expected
        self.timeline = PipelineTimeline(strategy, out) if isinstance(strategy, PipelineParallel) else None
        self.saved_activation_bytes = 0  # of the first step measured, for ranks.json
        self.expected_activation_bytes: int | None = None  # ... and the activation model's for it
        self.first_comm_bytes: dict[str, int] | None = None  # ... and its collectives' bytes
        every = strategy.cfg.train.measure_comm
        self._counter = CommTimeline() if strategy.env.distributed and every != "off" else None
        self._every_step = every == "every" or (every == "auto" and strategy.env.device.type == "cpu")
        self._first = False
        self._measured = False

    def header_lines(self) -> list[str]:
        """What the run's header says of the measurements set up: a pipeline's cut, modelled."""
        return cut_lines(self.timeline.modelled) if self.timeline else []

    def rank_record(self) -> dict:
        """This rank's part of ranks.json: a pipeline's cut (its stages, their layers, the modelled
        figures of the cut and of the even one)."""
        if not self.timeline:
            return {}
        lay = self.strategy.layout
        held = {s: list(lay.layers_of(s)) for s in self.strategy.stage_ids}
        return {"pipeline": {"stages": held, **self.timeline.modelled}}

    @contextlib.contextmanager
    def watch(self, step: int) -> Iterator[None]:
        """Around the step's forward, backward and update (inside its timing)."""
        self._first = first = step == self.first_step
        self.strategy.activation_probe = SavedActivations(self.model) if first else None
        self._measured = self._counter is not None and (first or self._every_step)
        if not self._measured:
            yield
            return
        self._counter.reset()
        self._counter.begin()
        with self._counter:
            yield
        self._overlap = self._counter.summary()

    def report(self, step: int, examples: list) -> dict:
        """The measured figures of step `step` (on `examples`), merged into its record."""
        # The timeline gathers every rank's passes: a collective, outside the step's timing.
        record = self.timeline.report(step) if self.timeline else {}
        probe = self.strategy.activation_probe
        if probe is not None:
            self.saved_activation_bytes = record["saved_activation_bytes"] = probe.bytes  # 1st micro-batch
            self.expected_activation_bytes = self.expected_saved(examples)
            if self.expected_activation_bytes is not None:
                record["saved_activation_bytes_expected"] = self.expected_activation_bytes
        if self._measured:
            record["comm_bytes"] = dict(self._counter.stats.bytes)
            record["comm_calls"] = dict(self._counter.stats.calls)
            if len(self._counter.stats.by_dim) > 1:  # several process groups: bytes per mesh dimension
                record["comm_bytes_by_dim"] = self._counter.stats.by_dim
            record.update(self._overlap)
            if self._first:
                self.first_comm_bytes = record["comm_bytes"]
                expected = self.expected_bytes(examples)
                if expected is not None:
                    record["comm_bytes_expected"], by_dim = expected
                    if by_dim is not None:
                        record["comm_bytes_expected_by_dim"] = by_dim
        return record
