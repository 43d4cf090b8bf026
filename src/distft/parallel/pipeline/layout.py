"""Which rank holds which stage and which layers: a pure function of the config and the
architecture, nothing distributed.

The model is cut into S = p x V stages (p pipeline ranks, V stages per rank) of contiguous decoder
layers. How many layers each stage takes is `parallel.pp_split` (`cut_layers`): balanced (the
default) by the modelled cost of each stage (`distft.parallel.pipeline.cost`: the head makes the
last stage heavier than its layers), even by layer count, or a list given by hand. `layout(cfg)`
checks the schedule and the batch before launch, when the architecture may not be known yet;
`Layout.cut` then fixes the layers, the same way wherever the architecture is known (the strategy,
the planner). Looped schedules put stage s on rank s mod p; V-shaped ones (zbv) go down the ranks
and back, so rank 0 holds the first and the last stage. Nothing is sent here: `Layout` only answers
where things live, and `Layout.theoretical_idle_fraction` is the one bubble formula (equal stage
times, free messages) that the strategy's timeline and the planner both report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from distft.config import Config
from distft.errors import ConfigError
from distft.parallel.pipeline.cost import CostModel, even_cut

# schedule name (`config.choices.PIPELINE_SCHEDULES`, which the config is checked against) -> (torch
# class, stages per rank when parallel.stages_per_rank is 0, V-shaped placement)
SCHEDULES: dict[str, tuple[type, int, bool]] = {
    "gpipe": (ScheduleGPipe, 1, False),  # all forwards, then all backwards (fill, drain)
    "1f1b": (Schedule1F1B, 1, False),  # one forward, one backward in the steady state
    "interleaved-1f1b": (ScheduleInterleaved1F1B, 2, False),  # 1F1B over V looped stages per rank
    "zero-bubble": (ScheduleInterleavedZeroBubble, 1, False),  # B split into input (B) and weight (W)
    "zbv": (ScheduleZBVZeroBubble, 2, True),  # zero bubble, 2 stages per rank placed in a V
}
SINGLE_STAGE = ("gpipe", "1f1b")  # torch's PipelineScheduleSingle: exactly one stage per rank
SPLIT_BACKWARD = ("zero-bubble", "zbv")  # backward split into input (B) and weight (W) passes


@dataclass(frozen=True)
class Layout:
    schedule: str
    ranks: int  # p: pipeline ranks (the whole world under pp; parallel.pp on a mesh)
    stages_per_rank: int  # V
    microbatches: int  # m
    micro_batch_size: int  # sequences per micro-batch
    layers_per_stage: tuple[int, ...] = ()  # the cut (`cut`); empty until the architecture is known

    @property
    def num_stages(self) -> int:
        return self.ranks * self.stages_per_rank

    @property
    def v_shaped(self) -> bool:
        return SCHEDULES[self.schedule][2]

    def rank_of(self, stage: int) -> int:
        """Looped: stage s on rank s mod p. V-shaped: down the ranks, then back up (0,1,..,p-1,p-1,..,0)."""
        p = self.ranks
        if self.v_shaped:
            return stage if stage < p else 2 * p - 1 - stage
        return stage % p

    def stages_of(self, rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.rank_of(s) == rank]

    def boundaries_of(self, rank: int) -> int:
        """Stage boundaries `rank` sends across, each way: every (s, s + 1) with the two stages on
        different ranks, one of them this one (a V-shaped turn stays on its rank). Per micro-batch
        the activation crosses forward and its gradient backward: the runtime's expected bytes and
        the planner both count a rank's sends and receives with it."""
        pairs = ((self.rank_of(s), self.rank_of(s + 1)) for s in range(self.num_stages - 1))
        return sum(src != dst and rank in (src, dst) for src, dst in pairs)

    def sends_of(self, rank: int) -> int:
        """Stage boundaries `rank` sends an activation across forward (it holds the earlier stage)."""
        return sum(self.rank_of(s) == rank != self.rank_of(s + 1) for s in range(self.num_stages - 1))

    def layers_of(self, stage: int) -> range:
        """The decoder layers of `stage`: contiguous, as many as the cut gives it."""
        if not self.layers_per_stage:
            raise ValueError("this layout is not cut into layers yet: Layout.cut(costs, parallel.pp_split)")
        start = sum(self.layers_per_stage[:stage])
        return range(start, start + self.layers_per_stage[stage])

    def cut(self, costs: CostModel, split: str | Sequence[int], model: str = "the model") -> Layout:
        """This layout with its layers cut as `split` (parallel.pp_split) says, by `costs`."""
        return replace(self, layers_per_stage=cut_layers(split, costs, self.num_stages, model))

    def theoretical_idle_fraction(self) -> float:
        """Idle share of each rank's step with equal stage times and free messages (docs/pp.md).

        Each rank waits p-1 slots while the pipeline fills and drains, out of m busy ones:
        (p-1)/(m+p-1) for gpipe and 1f1b alike; interleaving makes a slot V times shorter,
        (p-1)/(V m+p-1); zero bubble, with F = B = W, leaves p-1 single-unit slots of 3 V m busy ones.
        """
        p, m, v = self.ranks, self.microbatches, self.stages_per_rank
        if self.schedule in SPLIT_BACKWARD:  # F = B(input) = W: 3 V m busy units per rank
            return (p - 1) / (3 * v * m + p - 1)
        return (p - 1) / (v * m + p - 1)  # V = 1 for gpipe and 1f1b


def layout(cfg: Config, ranks: int | None = None, replicas: int = 1) -> Layout:
    """The pipeline described by `cfg`, checked; raises ConfigError for one that cannot run.

    `ranks`: pipeline ranks (default: the world size); `replicas`: data-parallel copies of the
    pipeline (ddp+pp, fsdp+pp, fsdp+tp+pp), each running its share of the global batch through its own schedule.
    """
    par, train = cfg.parallel, cfg.train  # parallel.schedule is one of SCHEDULES (`config.fields`)
    p = ranks or cfg.world_size
    if p < 2:
        raise ConfigError("--strategy pp splits the model across processes: use --nproc 2 or more.")
    if par.stages_per_rank < 0 or par.microbatches < 0:
        raise ConfigError("`parallel.stages_per_rank` and `parallel.microbatches` cannot be negative.")
    if train.global_batch_size % replicas:
        raise ConfigError(
            f"train.global_batch_size ({train.global_batch_size}) must be a multiple of parallel.dp ({replicas}): "
            "each data-parallel pipeline replica runs an equal share."
        )
    batch = train.global_batch_size // replicas  # sequences through one pipeline per step
    what = (
        f"train.global_batch_size ({batch})"
        if replicas == 1
        else f"each replica's share of train.global_batch_size ({train.global_batch_size} / {replicas} = {batch})"
    )
    if not par.microbatches and batch % train.micro_batch_size:
        raise ConfigError(
            f"{what} must be a multiple of train.micro_batch_size "
            f"({train.micro_batch_size}), or set the number of micro-batches with parallel.microbatches."
        )
    v = par.stages_per_rank or SCHEDULES[par.schedule][1]
    _check_stages(par.schedule, v)
    m = par.microbatches or batch // train.micro_batch_size
    if batch % m:
        raise ConfigError(
            f"{what} cannot be cut into {m} equal micro-batches: parallel.microbatches must divide it."
        )
    _check_microbatches(par.schedule, p, m)
    if isinstance(par.pp_split, list) and len(par.pp_split) != p * v:
        raise ConfigError(
            f"parallel.pp_split={par.pp_split} gives {len(par.pp_split)} stages, but parallel.schedule="
            f"{par.schedule} on {p} pipeline ranks x {v} stages per rank has {p * v}: list {p * v} layer "
            "counts, or use parallel.pp_split=balanced (or even)."
        )
    return Layout(par.schedule, p, v, m, batch // m)


def cut_layers(
    split: str | Sequence[int], costs: CostModel, stages: int, model: str = "the model"
) -> tuple[int, ...]:
    """Layers per stage as parallel.pp_split says: `balanced` by modelled cost (`cost.balanced_cut`),
    `even` by count, or the list itself, which must give every one of `stages` stages a layer and
    place every one of `model`'s layers exactly once (a ConfigError names the numbers)."""
    layers = costs.num_layers
    if stages > layers:
        raise ConfigError(
            f"{stages} pipeline stages need at least one decoder layer each, but {model} has {layers}."
        )
    if split == "balanced":
        return costs.balanced_cut(stages)
    if split == "even":
        return even_cut(layers, stages)
    cut = tuple(split)
    if len(cut) != stages:
        raise ConfigError(
            f"parallel.pp_split={list(cut)} gives {len(cut)} stages, but the pipeline has {stages}: list "
            f"{stages} layer counts, or use parallel.pp_split=balanced (or even)."
        )
    if min(cut) < 1 or sum(cut) != layers:
        raise ConfigError(
            f"parallel.pp_split={list(cut)} places {sum(cut)} decoder layers, but {model} has {layers}: "
            f"give each of the {stages} stages at least one layer, {layers} in all "
            f"(e.g. {list(even_cut(layers, stages))})."
        )
    return cut


def _check_stages(schedule: str, v: int) -> None:
    """Stages per rank the schedule can place."""
    if schedule in SINGLE_STAGE and v != 1:
        raise ConfigError(
            f"parallel.schedule={schedule} runs one stage per rank, but parallel.stages_per_rank={v}. "
            "Use parallel.schedule=interleaved-1f1b (or zero-bubble) for several stages per rank."
        )
    if schedule == "zbv" and v != 2:
        raise ConfigError(f"parallel.schedule=zbv places exactly 2 stages per rank (a V); got {v}.")


def _check_microbatches(schedule: str, p: int, m: int) -> None:
    """Micro-batch counts the schedule can run on p ranks."""
    if schedule == "1f1b" and m < p:
        raise ConfigError(
            f"parallel.schedule=1f1b needs at least as many micro-batches as pipeline ranks ({p}), got {m}: "
            f"raise parallel.microbatches (or train.global_batch_size), e.g. parallel.microbatches={2 * p}."
        )
    if schedule in ("interleaved-1f1b", "zero-bubble"):
        rounds = max(1, m // p)  # torch runs these in rounds of equal size
        if m % rounds:
            raise ConfigError(
                f"parallel.schedule={schedule} runs the micro-batches in max(1, m // p) = {rounds} rounds of "
                f"equal size, which m = {m} over p = {p} ranks does not allow. Use a multiple of {p}, "
                f"e.g. parallel.microbatches={p * rounds}."
            )
