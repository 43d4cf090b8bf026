"""What the planner is asked about besides the model: precision, what trains, and how ranks split it.

- `Precision` / `PRECISIONS` (`distft.config.precision`): bytes per weight, gradient, master copy,
  AdamW moment, activation;
- `Training`: the method, batch shape, LoRA settings and NF4 storage (the runtime's `NF4Spec`);
- `Parallelism`: the degrees (dp, tp, pp), what data parallelism shards, which TP implementation,
  and the pipeline schedule and cut. Its `pipeline()` is the runtime's own
  `distft.parallel.pipeline.Layout`, cut by `pipeline_layout` with the runtime's own stage cost
  model (`cost_model`: the same FLOPs, with `Training.label_tokens` labelled positions per
  sequence where the runtime measures its data's), so stage placement (`rank_layers`) and the
  bubble are the ones `distft train` runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distft.config.precision import PRECISIONS, Precision
from distft.layout import SPECS, ParallelDims, StrategySpec
from distft.model.nf4 import NF4Spec
from distft.parallel.pipeline import SCHEDULES
from distft.parallel.pipeline import Layout as PipelineLayout
from distft.parallel.pipeline.cost import DEFAULT_LABEL_TOKENS, CostModel
from distft.plan.model_spec import DEFAULT_LORA_TARGETS, ModelSpec


@dataclass(frozen=True)
class Training:
    """What is trained and on what batch: everything the memory model needs besides the layout."""

    method: str = "lora"  # full | lora | qlora
    precision: Precision = PRECISIONS["mixed"]
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    lora_dropout: float = 0.0
    # lora.variant=dora: a trained fp32 magnitude per output feature of each adapted projection
    dora: bool = False
    fp32_masters: bool = False  # full finetuning, train.master_weights=fp32: weights, grads, moments in fp32
    adapter_bytes: int = 4  # PEFT keeps adapters in fp32 over a 16-bit base (autocast_adapter_dtype)
    optimizer: str = "adamw"  # optim.name: adamw | adamw-8bit | sgd (`plan.optimizer`)
    sgd_momentum: bool = True  # sgd keeps a momentum buffer (optim.momentum > 0)
    reference_forward: bool = False  # DPO: a no-grad forward of the base under the adapters per micro-batch
    pair_statistics: int = 0  # a preference objective's sums all-reduced each step (`model.preference.STATS`)
    # KTO: forwards without backward per micro-batch before the step (its KL term: the policy's,
    # with the reference's inside it unless precomputed), and the sum they all-reduce.
    kl_forwards: int = 0
    modules_to_save: tuple[str, ...] = ()  # LoRA: modules trained whole beside the adapters (a copy each)
    trainable_tokens: int = 0  # LoRA: added tokens whose embedding (and untied lm_head) rows train
    autocast: bool = True  # bf16 autocast around forward/backward (distft on CUDA; off on CPU)
    seq_len: int = 2048
    micro_batch: int = 1
    # Positions per sequence that carry the loss (distft: the summary); the runtime measures its data's.
    label_tokens: int = DEFAULT_LABEL_TOKENS
    activation_checkpointing: str = "none"  # none | full | selective | offload (`distft.model.checkpointing`)
    mlp_tiles: int = 0  # the MLP in this many checkpointed sequence slices (0, 1: whole)
    attention: str = "auto"  # auto | flex | flash (no dense mask) | sdpa (dense mask when padded) | eager
    rope_scaling: str = "none"  # positions past the model's (`distft.model.positions`); no memory
    rope_factor: float = 0.0
    padded: bool | None = None  # a padding mask reaches attention; None: micro_batch > 1
    # data.packing: the micro-batch's sequences end to end in one row of B x S, with document ids
    # (a running step's packed row: B = 1, S its length)
    packed: bool = False
    device: str = "cuda"  # cuda | cpu: the kernels attention runs (`plan.attention`); `distft plan`: cuda
    quant: NF4Spec = field(default_factory=NF4Spec)  # the runtime's NF4 storage settings
    expert_imbalance: float = 1.0  # an MoE: the busiest EP rank's routed rows over the even share
    # (rows, positions) of each micro-batch of a step where a running step knows them (dynamic
    # padding, packed rows); empty: `Parallelism.microbatches` of (micro_batch, seq_len).
    batch_shapes: tuple[tuple[int, int], ...] = ()
    kl_batch_shapes: tuple[tuple[int, int], ...] = ()  # KTO's KL micro-batches; empty: as `batch_shapes`
    # FSDP2's MixedPrecisionPolicy as parallel.fsdp_*_dtype sets it, bytes per element; 0: the default.
    fsdp_param_bytes: int = 0
    fsdp_reduce_bytes: int = 0
    fsdp_output_bytes: int = 0

    @property
    def lora(self) -> bool:
        return self.method in ("lora", "qlora")

    @property
    def checkpointed(self) -> bool:
        return self.activation_checkpointing != "none"

    @property
    def has_padding_mask(self) -> bool:
        return self.micro_batch > 1 if self.padded is None else self.padded

    def shapes(self, microbatches: int) -> tuple[tuple[int, int], ...]:
        """(rows, positions) of each of a step's micro-batches."""
        return self.batch_shapes or ((self.micro_batch, self.seq_len),) * microbatches


@dataclass(frozen=True)
class DDPSettings:
    """DDP's switches (parallel.ddp_*), and what only a running DDP model knows: its buffers'
    bytes and its bucket count after the rebuild (0 before launch: a few hundred bytes unplanned)."""

    no_sync: bool = True
    find_unused: bool = False
    broadcast_buffers: bool = False
    static_graph: bool = False
    buffer_bytes: int = 0
    buckets: int = 0


@dataclass(frozen=True)
class Parallelism:
    """A layout as the planner estimates it: the strategy (`name`, its spec in `distft.layout.SPECS`),
    the degrees of its mesh (`dims`, the runtime's own `ParallelDims`), and the schedule and
    settings that change what a step moves. world = dp x tp x pp x cp."""

    name: str
    dims: ParallelDims = field(default_factory=ParallelDims)
    fsdp_prefetch: int = 1  # layers gathered ahead (distft's parallel.fsdp_prefetch)
    sp: bool = False
    schedule: str = "1f1b"  # parallel.schedule
    microbatches: int = 1  # micro-batches per optimizer step on each pipeline / replica
    stages_per_rank: int = 0  # parallel.stages_per_rank; 0: the schedule's default (SCHEDULES)
    pp_split: str | tuple[int, ...] = "balanced"  # parallel.pp_split: balanced, even, or layers per stage
    cp_method: str = "allgather"  # parallel.cp_method: K/V gathered (allgather) or passed round (ring)
    shard_experts: bool = False  # fsdp+ep: the expert groups' stacks FSDP-sharded across the dp / ep groups
    ddp: DDPSettings = DDPSettings()
    # fsdp+pp: (stage, all-gathers per step) of this rank's stages, as its schedule's UNSHARD actions
    # say (a running pipeline's); empty: `fsdp_pipeline_gathers`, one each.
    stage_gathers: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, spec: StrategySpec, dims: ParallelDims, **schedule) -> Parallelism:
        """`spec`'s strategy at `dims`, the degrees the runtime builds its mesh from (HSDP's shard
        group, fsdp+ep's expert group among them); `schedule`: micro-batches, pipeline schedule and
        cut, the experts' layout."""
        return cls(spec.name, dims, **({"sp": spec.tensor_parallel == "megatron"} | schedule))

    @classmethod
    def at(
        cls,
        name: str,
        dp: int = 1,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        shard: int = 0,
        ep: int = 0,
        **schedule,
    ) -> Parallelism:
        """Strategy `name` at these degrees (`ParallelDims.split`: shard groups of `shard`, expert
        groups of `ep`)."""
        spec = SPECS[name]
        return cls.of(spec, ParallelDims.split(spec, dp, tp=tp, pp=pp, cp=cp, shard=shard, ep=ep), **schedule)

    # The degrees, the layout's (`dims`).
    @property
    def dp(self) -> int:
        """Data-parallel degree: replicas (DDP), or shards (ZeRO, FSDP), or both (HSDP)."""
        return self.dims.dp

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def cp(self) -> int:
        """Context-parallel degree: ranks sharing each sequence (1/cp of its positions each)."""
        return self.dims.cp

    @property
    def ep(self) -> int:
        """Expert-parallel degree (fsdp+ep: ep consecutive data-parallel ranks hold 1/ep of the experts each)."""
        return self.dims.ep

    @property
    def dp_shard(self) -> int:
        """HSDP's shard group (parallel.shard): ranks sharding each parameter; 0 where every
        data-parallel rank shards it."""
        return self.dims.dp_shard if SPECS[self.name].shard_groups else 0

    # What the strategy is, read from its spec (`distft.layout.SPECS`), not restated here.
    @property
    def shard(self) -> str:
        """What data parallelism shards: none | optimizer (ZeRO-1) | full (FSDP2)."""
        return SPECS[self.name].shards

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2: ZeRO-3 (True) or ZeRO-2 and the pipelines (False)."""
        return SPECS[self.name].reshard_after_forward

    @property
    def tensor_parallel(self) -> str:
        """How TP splits a layer: dtensor (parallelize_module) | megatron (tp-sp's hand-written layers)."""
        return SPECS[self.name].tensor_parallel or "megatron"

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def shard_degree(self) -> int:
        """Ranks each parameter is split across by ZeRO/FSDP (HSDP: one shard group; FSDP folds
        the context-parallel ranks in: dp x cp)."""
        return self.dp_shard or self.dp * (self.cp if self.shard == "full" else 1)

    @property
    def replicas(self) -> int:
        """HSDP's replicate degree: shard groups holding the same shards (1 for FSDP)."""
        return self.dp * (self.cp if self.shard == "full" else 1) // self.shard_degree

    @property
    def virtual_stages(self) -> int:
        """V: pipeline stages per rank, as the runtime resolves parallel.stages_per_rank."""
        return self.stages_per_rank or SCHEDULES[self.schedule][1]

    def pipeline(self, micro_batch_size: int = 1) -> PipelineLayout:
        """The runtime's pipeline layout for these degrees (a one-rank pipeline without pp)."""
        return PipelineLayout(
            self.schedule, self.pp, self.virtual_stages, self.microbatches, micro_batch_size
        )

    def idle_fraction(self) -> float:
        """The pipeline's bubble as a share of step time (the runtime's equal-stage theory)."""
        return self.pipeline().theoretical_idle_fraction() if self.pp > 1 else 0.0


def compute_bytes(training: Training, par: Parallelism) -> int:
    """Bytes per element of the activations collectives carry: FSDP2's param dtype where
    parallel.fsdp_param_dtype sets it (the layers compute in it), else the precision's."""
    return (par.shard == "full" and training.fsdp_param_bytes) or training.precision.activation


def cost_model(spec: ModelSpec, training: Training) -> CostModel:
    """The runtime's stage cost model (`distft.parallel.pipeline.cost`) of `spec` trained as
    `training` says, with its `label_tokens` labelled positions per sequence."""
    return CostModel.from_config(
        spec,
        training.method,
        training.lora_rank,
        training.lora_targets,
        training.seq_len,
        training.label_tokens,
    )


def pipeline_layout(spec: ModelSpec, training: Training, par: Parallelism) -> PipelineLayout:
    """The runtime's pipeline for these degrees, its layers cut as `par.pp_split` says."""
    return par.pipeline().cut(cost_model(spec, training), par.pp_split, spec.name)


def rank_layers(spec: ModelSpec, training: Training, par: Parallelism, rank: int) -> list[int]:
    """Decoder layers pipeline rank `rank` holds: those of every stage the runtime places on it."""
    if par.pp == 1:
        return list(range(spec.num_layers))
    lay = pipeline_layout(spec, training, par)
    return [i for s in lay.stages_of(rank) for i in lay.layers_of(s)]


def rank_stages(spec: ModelSpec, training: Training, par: Parallelism, rank: int) -> list[tuple[int, bool]]:
    """(decoder layers, is the first stage) of every stage pipeline rank `rank` holds (the whole
    model, first, without a pipeline)."""
    if par.pp == 1:
        return [(spec.num_layers, True)]
    lay = pipeline_layout(spec, training, par)
    return [(len(lay.layers_of(s)), s == 0) for s in lay.stages_of(rank)]


def holds_first_stage(par: Parallelism, rank: int) -> bool:
    return par.pipeline().rank_of(0) == rank


def holds_last_stage(par: Parallelism, rank: int) -> bool:
    lay = par.pipeline()
    return lay.rank_of(lay.num_stages - 1) == rank
