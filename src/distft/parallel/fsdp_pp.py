"""2D parallelism (`fsdp+pp`): FSDP2 shards each pipeline stage across the replicas of a pipeline.

The ranks form a ("pp", "dp") `DeviceMesh` (`distft.layout.ParallelDims`, pp outermost),
as under `ddp+pp` (`pipeline/replicas.py`): with dp = pp = 2, ranks {0, 2} are pipeline 0 and
{1, 3} pipeline 1; {0, 1} shard stage 0 and {2, 3} stage 1. Built in torchtitan's order: cut the
model into stages, then `fully_shard` each stage's decoder layers and the stage itself (its
embedding, or final norm + lm_head) over mesh["dp"] (`fsdp.shard_units`), then build torch's
`PipelineStage`s and the schedule. torch's stage sees an FSDP module and, for every micro-batch,
turns off gradient reduction and resharding; after the last backward of the step it reduces
(`PipelineStage.perform_reduce_grad`).

What each rank holds: 1/dp of its stage(s)' parameters (dim-0 shards, padded to a multiple of
dp), of their gradients and of their AdamW state, between steps. During a step the whole stage is
gathered (`reshard_after_forward=False`, torchtitan's choice under a pipeline: a stage runs m
forwards and m backwards, and regathering it for each would multiply the traffic by 2m), and its
unsharded gradients accumulate until the step's reduce-scatter.

What runs on which mesh dimension, per optimizer step:
- dp (FSDP, the ranks of one stage): one all-gather of each unit (layer, stage root) at its first
  forward; one reduce-scatter of its trainable gradients after the last backward. (Schedules with
  several stages per rank gather each stage when the schedule's UNSHARD action says: once per step.)
- pp (inside a pipeline): the schedule's send/recv of one (mb, seq, hidden) activation per
  micro-batch per stage boundary forward and of its gradient backward; full finetuning of a tied
  embedding: the sum of the two copies' gradient shards between the first and last stage's ranks;
- all ranks: the loss sum (last stages have one each) and the gradient norm's float64 sum of
  squares (every shard of every stage once).

FSDP's reduce-scatter averages over dp, while a pipeline's gradient is already d(its token-loss
sum / the global label-token count), to be summed over the replicas: the loss is multiplied by
dp before backward (`loss_scale`), as `Strategy.forward_backward` does for 1D FSDP.

QLoRA: the NF4 base weights shard and gather through torchao's FSDP hooks, as under `fsdp`.

Papers: GPipe (1811.06965), PipeDream 1F1B (1806.03377); ZeRO (1910.02054), PyTorch FSDP
(2304.11277); torchtitan (2410.06511) for the composition.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig

from distft.config import Config
from distft.errors import ConfigError
from distft.parallel.fsdp import FSDP, shard_units
from distft.parallel.pipeline.layout import SINGLE_STAGE
from distft.parallel.pipeline.replicas import MeshPipeline
from distft.parallel.pipeline.stages import StageModule


class FSDPPipelineParallel(MeshPipeline):
    name = "fsdp+pp"

    @classmethod
    def validate_config(cls, cfg: Config) -> None:
        FSDP.validate_config(cfg)  # the fsdp_* settings apply to the dp dimension
        super().validate_config(cfg)

    @classmethod
    def nf4_shards(cls, cfg: Config) -> int:
        return cls.data_parallel_size(cfg)

    def __init__(self, cfg: Config, env) -> None:
        super().__init__(cfg, env)
        self.loss_scale = self.dims.dp  # FSDP averages over dp; the replicas' gradients must add up

    @classmethod
    def validate_model(cls, cfg: Config, model_config: PretrainedConfig) -> None:
        super().validate_model(cfg, model_config)
        lay = cls.pipeline_layout(cfg)
        if lay.v_shaped and cfg.train.method == "full" and model_config.tie_word_embeddings:
            raise ConfigError(
                f"--strategy {cls.name} with parallel.schedule={lay.schedule} puts the first and the last "
                "stage on one rank, where FSDP shards them as two units: "
                f"{cfg.model.name}'s tied embedding and lm_head would become two weights and train apart "
                "under --method full. Use parallel.schedule=1f1b (or gpipe, interleaved-1f1b, zero-bubble), "
                "or --method lora."
            )

    # -- set-up --------------------------------------------------------------------------------
    def parallelize(self, model: nn.Module) -> nn.Module:
        self.tie = (model.backbone.embed_tokens, model.lm_head)  # the modules a tied weight lives in
        return super().parallelize(model)

    def shard_stage(self, module: StageModule, stage: int) -> None:
        self.split_stage(module)
        embed, lm_head = self.tie
        tied = embed.weight is lm_head.weight
        shard_units(module, module.layers.values(), self.mesh["dp"], self.cfg, reshard_after_forward=False)
        # fully_shard replaced the stage's copy of a tied weight by its shard; point the other end
        # (not on this rank) at it too, or it would keep the whole unsharded matrix alive here.
        last = self.layout.num_stages - 1
        if tied and (0 in self.stage_ids) != (last in self.stage_ids):
            if module.embed_tokens is not None:
                lm_head.weight = embed.weight
            elif module.lm_head is not None:
                embed.weight = lm_head.weight

    def split_stage(self, module: StageModule) -> None:
        """Split a stage's layers before FSDP shards them (fsdp+tp+pp: tensor parallelism)."""

    def traffic_facts(self, model: nn.Module) -> dict:
        return {
            **super().traffic_facts(model),
            "stage_gathers": tuple((s, self.gathers_per_step(s)) for s in self.stage_ids),
        }

    def gathers_per_step(self, stage: int) -> int:
        """All-gathers of each of `stage`'s FSDP units per step: one (gpipe, 1f1b: at its first
        forward); under the multi-stage schedules, one per UNSHARD action torch's schedule plans
        for it (it keeps up to 3 stages gathered, so with V <= 3 also one: what `distft plan`
        counts, `plan.counts.fsdp_pipeline_gathers`)."""
        if self.layout.schedule in SINGLE_STAGE:
            return 1
        actions = self.schedule.pipeline_order_with_comms[self.pp_rank]
        return sum(a.stage_index == stage and a.computation_type.name == "UNSHARD" for a in actions)

    # -- one step ------------------------------------------------------------------------------
    def release_gathered(self, model: nn.Module) -> None:
        # A stage stays gathered through a step (no reshard after forward); KTO's KL term inside a
        # step leaves it gathered for the schedule that follows: one gather a step.
        for stage in self.stages:
            for module in stage.submod.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    # -- gradients and export ------------------------------------------------------------------
    def norm_group(self) -> None:
        return None  # every rank: the shards of a stage over dp, the stages over pp

    def grad_copies(self, g: DTensor) -> int:
        # A stage lives on dp x tp ranks; a gradient on the dp sub-mesh only is held by each TP rank.
        return super().grad_copies(g) * (self.dims.dp * self.dims.tp // g.device_mesh.size())

    def exports_stage(self) -> bool:
        coords = self.dims.coordinates(self.env.rank)
        return coords["dp"] == 0 and coords["tp"] == 0  # one copy of each gathered stage
