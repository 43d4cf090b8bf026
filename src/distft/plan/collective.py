"""One collective of a step as the bytes formula counts it, and the rules every formula shares.

- `Collective`: what moves (logical bytes per step, `distft.measure.comm`'s convention), how many
  calls, over how many ranks and which link, whether compute can hide it, along which mesh
  dimension; `Topology`: which link a group of ranks crosses.
- `held_bytes`: a rank's slice of the model as ZeRO and FSDP2 move it (padding, dtypes, NF4).
- `step_positions`: a step's positions (the activations' element size: `inputs.compute_bytes`).
- `bytes_by_kind`, `bytes_by_dim`: a step's collectives summed as a run's counter sums them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distft.model.nf4 import nf4_gathered_bytes
from distft.plan.experts import expert_parallel, expert_shards
from distft.plan.hardware import Link, comm_time, wire_bytes
from distft.plan.inputs import Parallelism, Training
from distft.plan.memory import (
    layer_seq_len,
    local_shape,
    param_element_bytes,
    stage_tensors,
    trained_element_bytes,
)
from distft.plan.model_spec import ModelSpec


@dataclass
class Collective:
    what: str  # gradients, parameters, activations, ...
    kind: str  # all_reduce, all_gather, reduce_scatter, send
    logical_bytes: float  # per step, all calls together
    calls: int
    group: int  # ranks taking part
    link: Link
    overlapped: bool  # can hide behind compute
    dim: str = ""  # the mesh dimension it runs over, as a run's counter names it (`CommStats.by_dim`)

    @property
    def wire_bytes(self) -> float:
        return wire_bytes(self.kind, self.logical_bytes, self.group)

    @property
    def seconds(self) -> float:
        return comm_time(self.kind, self.logical_bytes, self.group, self.link, self.calls)


@dataclass(frozen=True)
class Topology:
    gpus_per_node: int
    nodes: int
    intra: Link
    inter: Link

    def link(self, size: int, stride: int) -> Link:
        """The slowest link a group of `size` ranks `stride` apart crosses."""
        return self.inter if self.nodes > 1 and size * stride > self.gpus_per_node else self.intra


def held_bytes(
    spec: ModelSpec,
    training: Training,
    par: Parallelism,
    what: str,
    rank: int = 0,
    stage: int | None = None,
    layers_only: bool = False,  # the decoder layers' tensors alone (not the root's)
    experts: bool = False,  # fsdp+ep's expert stacks alone, FSDP-sharded across its groups
) -> float:
    """Logical bytes of pipeline rank `rank`'s TP/PP slice of the model (or of its stage `stage`),
    FSDP2's dim-0 padding included: `gradients` (trainable, in the gradient dtype; FSDP2's reduce
    dtype), `trained` (trainable weights as stored: ZeRO-1's broadcast) or `gathered` (every weight
    as FSDP2 all-gathers it: in its param dtype, bf16 copies of fp32 master weights
    (`parallel.fsdp.mixed_precision`); an NF4 weight's inner tensors). Expert parallelism's stacks
    are apart: never gathered by the FSDP of the rest, and with `experts`, this rank's alone as FSDP2
    shards them across the expert groups (`parallel.shard_experts`)."""
    total, n = 0.0, expert_shards(par) if experts else par.shard_degree
    sharded = par.shard == "full"
    masters = training.fp32_masters and training.method == "full"
    for t, trains in stage_tensors(spec, training, par, rank, stage):
        skip = (what != "gathered" and not trains) or (layers_only and t.layer is None)
        if skip or expert_parallel(t, par) != experts:
            continue
        shape = local_shape(t, par.tp, 0, par.ep)
        numel = math.prod(shape)
        if what == "gathered" and training.method == "qlora" and t.kind == "linear":
            total += nf4_gathered_bytes(numel, training.quant, training.precision.param, n)
            continue
        if par.shard == "full" and n > 1 and shape[0]:
            numel = math.ceil(shape[0] / n) * n * (numel // shape[0])
        if what == "gradients":  # FSDP2 reduces in its reduce dtype, else its param dtype (not over masters)
            override = training.fsdp_reduce_bytes or (0 if masters else training.fsdp_param_bytes)
            element = (sharded and override) or trained_element_bytes(t, training)[0]
        elif what == "gathered":
            element = training.fsdp_param_bytes or (
                training.precision.param if masters else param_element_bytes(t, training)
            )
        else:
            element = param_element_bytes(t, training)
        total += numel * element
    return total


def step_positions(training: Training, par: Parallelism) -> int:
    """Positions in a step's micro-batches, each row as the layers see it (TP+SP pads it)."""
    return sum(rows * layer_seq_len(training, par, seq) for rows, seq in training.shapes(par.microbatches))


def bytes_by_kind(collectives: list[Collective]) -> dict[str, int]:
    """Logical bytes per collective kind (`distft.measure.comm`'s convention: what a run counts)."""
    out: dict[str, int] = {}
    for c in collectives:
        out[c.kind] = out.get(c.kind, 0) + int(c.logical_bytes)
    return out


def bytes_by_dim(collectives: list[Collective]) -> dict[str, dict[str, int]]:
    """`bytes_by_kind` per mesh dimension."""
    dims = dict.fromkeys(c.dim for c in collectives)
    return {d: bytes_by_kind([c for c in collectives if c.dim == d]) for d in dims}
