"""`StrategySpec`: what a parallel strategy is, as data. The strategy classes in `distft.parallel`
hold only how it runs (`parallelize`, `forward_backward`, ...) and point at their spec.

A spec names the mesh dimensions the strategy spans (`distft.layout.dims`), what data parallelism
shards, how it splits a layer, what each rank holds and moves (the README's table), and what it can
run: `capabilities` maps each optional feature to None where it runs, or to the reason it does not,
which the checks before launch show to the user.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

WORLD_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # the world's dimensions, outermost first
DIMS = (*WORLD_DIMS, "ep")  # and the expert groups, inside dp_shard (`distft.layout.dims`)

# The optional features a strategy runs or refuses, and the reason given by one that has not been
# taught to (a spec names its own reason where it has a better one).
NOT_TAUGHT: dict[str, str] = {
    "qlora": "this strategy has not been taught to place NF4 base weights",  # --method qlora
    "dora": "this strategy has not been taught to hold DoRA's magnitudes",  # lora.variant=dora
    "modules_to_save": "has not been taught to hold peft's trained module copies",  # and added tokens
    "fp8": "float8 Linear layers are taught to run whole or FSDP-gathered only",  # model.fp8
    "moe": "this strategy has not been taught to split a mixture of experts",  # an MoE family
    "compile": "it rewrites the decoder layers itself",  # model.compile=true
    "fp32_masters": "it computes with the weights it holds",  # train.master_weights=fp32
}
FEATURES = tuple(NOT_TAUGHT)


def runs(*features: str, **refused: str) -> dict[str, str | None]:
    """Capabilities: each of `features` runs; each of `refused` does not, for the reason given;
    every other feature does not either, for `NOT_TAUGHT`'s reason."""
    unknown = (set(features) | set(refused)) - set(FEATURES)
    assert not unknown, f"unknown features {unknown}"
    return {f: None if f in features else refused.get(f, NOT_TAUGHT[f]) for f in FEATURES}


@dataclass(frozen=True)
class StrategySpec:
    name: str  # --strategy NAME
    label: str  # how reports name it ("FSDP / ZeRO-3")
    holds: str  # what each rank holds
    moves: str  # the collectives of one optimizer step
    page: str = ""  # its page under docs/ (with an #anchor where it shares one)
    # The mesh dimensions it spans (`distft.layout.dims.DIMS`); () runs in one process.
    dims: tuple[str, ...] = ("dp_replicate",)
    shards: str = "none"  # what data parallelism shards: none | optimizer (ZeRO-1) | full (FSDP2)
    # FSDP2 frees a layer's gathered weights after its forward and gathers them again in backward
    # (ZeRO-3); False keeps them (ZeRO-2, and a pipeline's stages for the whole step).
    reshard_after_forward: bool = True
    tensor_parallel: str = ""  # how tp splits a layer: dtensor (parallelize_module) | megatron
    wraps: str = ""  # the torch wrapper whose parallel.* settings it reads: ddp | fully_shard
    fixed_sequence_length: bool = False  # pads every batch to data.max_length (pipelines)
    # The model's forward takes `label_positions` (`LossLM`): the loss head gathers the labelled
    # positions without a host sync. Pipelines and sequence splits compute their loss on their pieces.
    takes_label_positions: bool = True
    # Takes the whole model on this rank's device (single, DDP): the base is built there directly,
    # in its dtype. The others receive it on the CPU and place or shard it themselves.
    builds_on_device: bool = False
    optimizers: tuple[str, ...] = ("adamw", "sgd")  # optim.name values it builds and checkpoints
    capabilities: Mapping[str, str | None] = field(default_factory=runs)
    collectives: str = "collectives"  # what its step communicates, for error messages ("timed out in ...")
    # How it splits a layer's activations, where the planner picks it because they do not fit.
    splits_activations: str = ""
    # A pipeline composition with one pipeline rank, or one pipeline, is another strategy: which.
    without_pp: str = ""
    without_dp: str = ""

    def __post_init__(self) -> None:
        assert set(self.dims) <= set(DIMS) and len(set(self.dims)) == len(self.dims), self.name
        assert self.shards in ("none", "optimizer", "full"), self.name
        assert self.tensor_parallel in ("", "dtensor", "megatron"), self.name
        assert bool(self.tensor_parallel) == ("tp" in self.dims), self.name
        assert self.wraps in ("", "ddp", "fully_shard"), self.name
        assert (self.shards == "full") == ("dp_shard" in self.dims), self.name
        assert set(self.capabilities) == set(FEATURES), self.name

    # -- derived ---------------------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        """Needs a process group (launched through torchrun)."""
        return bool(self.dims)

    @property
    def pipelined(self) -> bool:
        """Runs a pipeline schedule (parallel.schedule, ...)."""
        return "pp" in self.dims

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes the ranks are split along, as the user sizes them: `dp` (replicas or shards:
        the rows), `pp`, `cp`, `tp`."""
        named = [("dp" if d.startswith("dp_") else d) for d in self.dims if d != "ep"]
        return tuple(dict.fromkeys(named))

    @property
    def sized(self) -> bool:
        """The user sets its degrees (parallel.dp / tp / pp / cp): it splits along several axes."""
        return len(self.axes) > 1

    @property
    def shard_groups(self) -> bool:
        """Takes parallel.shard: shard groups replicated across each other (HSDP)."""
        return {"dp_replicate", "dp_shard"} <= set(self.dims)

    @property
    def expert_groups(self) -> bool:
        """Takes parallel.ep: expert groups sharing a mixture of experts' experts (fsdp+ep)."""
        return "ep" in self.dims

    def runs(self, feature: str) -> bool:
        return self.capabilities[feature] is None

    def step_scalars(
        self, dp: int, sequence_split: bool = False, pair_statistics: int = 0, kl_sum: bool = False
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Bytes of each scalar a step all-reduces beside its tensors, (loss, norm): the loss sum (fp32, 4 B)
        where ranks hold different rows or positions (data-parallel replicas, a pipeline's last
        stage, a sequence split), with `pair_statistics` fp32 sums beside it (a preference
        objective's `distft.model.preference.STATS`, an MoE's router sums) and KTO's KL sum before
        them (`kl_sum`, fp32), and the squared gradient norm (float64, 8 B) where a gradient is
        sharded (FSDP, TP) or split across stages (`distft.parallel.grads.clip_grad_norm_`). The
        planner and the runtime's expected bytes both count them here."""
        reduced = dp > 1 or self.pipelined or sequence_split or "cp" in self.dims
        statistics = ((4 * pair_statistics,) if pair_statistics else ()) + ((4,) if kl_sum else ())
        loss = (4, *statistics) if reduced else ()
        norm = (8,) if self.shards == "full" or "tp" in self.dims or self.pipelined else ()
        return loss, norm

    def refusal(self, feature: str) -> str:
        """Why `feature` does not run under this strategy ("" where it does)."""
        return self.capabilities[feature] or ""
