"""What a running step should move and keep: the planner's formulas on the step itself.

There is one bytes-moved formula per strategy, `distft.plan.traffic`'s: `distft plan` evaluates it
on shapes, a run's prediction (`plan.auto.predict`) on its config, and the loop, here, on its first
step, which it records beside the bytes it counted (`comm_bytes_expected`; per mesh dimension,
`comm_bytes_expected_by_dim`, where HSDP's groups run). What the running process knows and a plan
does not, it passes in:
- the (rows, positions) of each of this rank's micro-batches (dynamic padding, packed rows);
- the architecture it built (`Run.architecture`: its config's shapes);
- `Strategy.traffic_facts`: a pipeline's cut as it ran, a schedule's all-gathers per stage, DDP's
  buffer bytes and rebuilt bucket count.

Likewise the activations the first micro-batch keeps for backward (`expected_activations`, beside
what `SavedActivations` measured of it): the activation model on that micro-batch's rows, positions
and documents, on this device's kernels, with the labelled positions this rank's loss runs on (a
context-parallel or sequence-parallel rank's share of them), where the run's prediction has the data's mean.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch
from torch import nn

from distft.config import Config
from distft.data import IGNORE
from distft.errors import ConfigError
from distft.layout import SPECS
from distft.parallel import Batch, Strategy
from distft.parallel.sequence_head import SequenceSplitHead
from distft.plan.activations import activation_bytes
from distft.plan.auto import on_cuda, parallelism_of, training_of
from distft.plan.collective import Topology, bytes_by_dim, bytes_by_kind
from distft.plan.hardware import Link
from distft.plan.inputs import PRECISIONS, DDPSettings, Parallelism
from distft.plan.model_spec import ModelSpec
from distft.plan.traffic import step_collectives

# Bytes do not depend on the links; a topology is needed to name the groups' links.
_ANY_LINK = Link("run", "the run's links", bandwidth=1.0, efficiency=1.0, latency_s=0.0)
_DDP_FACTS = {f.name for f in fields(DDPSettings)}


def running_layout(cfg: Config, strategy: Strategy, model: nn.Module) -> Parallelism:
    """The planner's `Parallelism` of the running strategy: its config's, with what only the running
    strategy knows (`Strategy.traffic_facts`), in the schedule that ran (traffic: any of them)."""
    facts = strategy.traffic_facts(model)
    par = parallelism_of(cfg, cfg.parallel.schedule)
    ddp = {k: v for k, v in facts.items() if k in _DDP_FACTS}
    return replace(par, ddp=replace(par.ddp, **ddp), **{k: v for k, v in facts.items() if k not in ddp})


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
    par = running_layout(cfg, strategy, model)
    topology = Topology(par.world, 1, _ANY_LINK, _ANY_LINK)
    try:
        collectives = step_collectives(spec, training, par, topology, strategy.pp_rank)
    except (ConfigError, ValueError):  # a layout the planner does not model
        return None
    # Where groups of several sizes run (HSDP's shard groups, fsdp+ep's expert groups): by dimension too.
    several = SPECS[cfg.parallel.strategy].shard_groups or 1 < par.ep < par.dp
    return bytes_by_kind(collectives), bytes_by_dim(collectives) if several else None


def _labelled(model: nn.Module, labels: torch.Tensor) -> int:
    """Labelled positions of `labels` this rank's loss runs on (a sequence-split model's own)."""
    split = next((m for m in model.modules() if isinstance(m, SequenceSplitHead)), None)
    return int(((split.own_labels(labels) if split else labels) != IGNORE).sum())


def expected_activations(
    cfg: Config, strategy: Strategy, model: nn.Module, spec: ModelSpec, batch: Batch
) -> int | None:
    """Bytes autograd should keep for backward on `batch`, this rank's first micro-batch (one
    micro-batch of its pipeline stage); None where the planner cannot model the run."""
    rows, positions = (int(n) for n in batch["input_ids"].shape)
    mask = batch.get("attention_mask")
    training = training_of(
        cfg,
        PRECISIONS["fp32" if cfg.model.dtype == "float32" else "bf16-pure"],
        autocast=on_cuda(cfg) and cfg.model.autocast,
        micro_batch=rows,
        seq_len=positions,
        label_tokens=_labelled(model, batch["labels"]) / rows,
        padded=mask is not None and bool((mask == 0).any()),
        packed="position_ids" in batch,
        device=strategy.env.device.type,
    )
    par = running_layout(cfg, strategy, model)
    try:
        return int(sum(activation_bytes(spec, training, par, strategy.pp_rank).detail.values()))
    except (ConfigError, ValueError):  # a layout the planner does not model
        return None
