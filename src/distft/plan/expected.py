"""The bytes a running step's collectives should move: the planner's formulas on the step itself.

There is one bytes-moved formula per strategy, `distft.plan.traffic`'s: `distft plan` evaluates it
on shapes, a run's prediction (`plan.auto.predict`) on its config, and the loop, here, on its first
step, which it records beside the bytes it counted (`comm_bytes_expected`; per mesh dimension,
`comm_bytes_expected_by_dim`, where HSDP's groups run). What the running process knows and a plan
does not, it passes in:
- the (rows, positions) of each of this rank's micro-batches (dynamic padding, packed rows);
- the architecture it built (`Run.architecture`: its config's shapes);
- `Strategy.traffic_facts`: a pipeline's cut as it ran, a schedule's all-gathers per stage, DDP's
  buffer bytes and rebuilt bucket count.
"""

from __future__ import annotations

from dataclasses import fields, replace

from torch import nn

from distft.config import Config
from distft.errors import ConfigError
from distft.layout import SPECS
from distft.parallel import Batch, Strategy
from distft.plan.auto import on_cuda, parallelism_of, training_of
from distft.plan.collective import Topology, bytes_by_dim, bytes_by_kind
from distft.plan.hardware import Link
from distft.plan.inputs import PRECISIONS, DDPSettings
from distft.plan.model_spec import ModelSpec
from distft.plan.traffic import step_collectives

# Bytes do not depend on the links; a topology is needed to name the groups' links.
_ANY_LINK = Link("run", "the run's links", bandwidth=1.0, efficiency=1.0, latency_s=0.0)
_DDP_FACTS = {f.name for f in fields(DDPSettings)}


def expected_step_bytes(
    cfg: Config,
    strategy: Strategy,
    model: nn.Module,
    spec: ModelSpec,
    batches: list[Batch],
    kl_batches: list[Batch] = (),
) -> tuple[dict[str, int], dict[str, dict[str, int]] | None] | None:
    """(bytes per kind, bytes per mesh dimension or None) this rank's collectives should move in a
    step over `batches`, its micro-batches (and KTO's `kl_batches`, scored before them); None where
    the planner cannot model the run."""
    precision = PRECISIONS["fp32" if cfg.model.dtype == "float32" else "bf16-pure"]

    def shapes_of(micro_batches: list[Batch]) -> tuple[tuple[int, int], ...]:
        return tuple((int(b["input_ids"].shape[0]), int(b["input_ids"].shape[1])) for b in micro_batches)

    training = training_of(
        cfg, precision, autocast=on_cuda(cfg) and cfg.model.autocast, batch_shapes=shapes_of(batches),
        kl_batch_shapes=shapes_of(kl_batches),
    )  # fmt: skip
    facts = strategy.traffic_facts(model)
    par = parallelism_of(cfg, cfg.parallel.schedule)  # the schedule that ran (traffic: any of them)
    ddp = {k: v for k, v in facts.items() if k in _DDP_FACTS}
    par = replace(par, ddp=replace(par.ddp, **ddp), **{k: v for k, v in facts.items() if k not in ddp})
    topology = Topology(par.world, 1, _ANY_LINK, _ANY_LINK)
    try:
        collectives = step_collectives(spec, training, par, topology, strategy.pp_rank)
    except (ConfigError, ValueError):  # a layout the planner does not model
        return None
    # Where groups of several sizes run (HSDP's shard groups, fsdp+ep's expert groups): by dimension too.
    several = SPECS[cfg.parallel.strategy].shard_groups or 1 < par.ep < par.dp
    return bytes_by_kind(collectives), bytes_by_dim(collectives) if several else None
