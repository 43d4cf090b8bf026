"""3D parallelism (`fsdp+tp+pp`): tensor parallelism inside each stage, FSDP across, pipeline outermost.

The ranks form a ("pp", "dp", "tp") `DeviceMesh` (`distft.layout.ParallelDims`), row-major
with tp fastest: with dp = tp = pp = 2 (8 ranks), rank = 4 pp + 2 dp + tp; {0, 1} is a TP group,
{0, 2} an FSDP group, {0, 4} a pipeline. Built in torchtitan's order: cut the model into stages
(`pipeline/`), split each stage's decoder layers over mesh["tp"] with the TP plan of
`tensor_parallel.py` (and its LoRA treatment), `fully_shard` each layer and the stage over
mesh["dp"] (`fsdp_pp.py`, FSDP shards each rank's TP slice), then build torch's stages and schedule.

The order follows the links: TP exchanges activations inside every layer, twice forward and
more backward, so it takes the neighbouring ranks (one node, the fastest links); FSDP moves each
stage's weights once per step, across TP groups; the pipeline sends one activation per
micro-batch per stage boundary, the cheapest traffic, so it is outermost and may cross nodes.

What each rank holds: of its stage(s), 1/(dp tp) of each projection and its TP-sharded adapter
(column: q, k, v, gate, up, lora_B; row: o, down, lora_A), 1/dp of what TP replicates (embedding
or final norm + lm_head, norms, column lora_A, row lora_B), the gradients and AdamW state of those
shards; during a step the stage's TP slice gathered whole (no reshard after forward, `fsdp_pp.py`).
A mixture of experts' stacks are split as under `fsdp+tp`: tp cuts every expert's features
(`tp_experts`), FSDP shards the slices, 1/(dp tp) of each expert per rank.

What runs on which mesh dimension, per optimizer step:
- tp (inside a stage): TP's activation all-reduces of each of the stage's layers, per micro-batch
  (after the row projections forward, at the column projections' inputs backward, LoRA's rank-r
  ones); with full finetuning q_norm / k_norm's partial gradients, after the schedule;
- dp (the ranks of one stage and TP index): one all-gather of each unit's TP-local parameters per
  step and one reduce-scatter of their trainable gradients after the last backward;
- pp (one pipeline per (dp, tp) index): the schedule's send/recv of the (mb, seq, hidden) hidden
  states and their gradients at each stage boundary; every TP rank sends its own (identical) copy
  to the TP rank of the same index in the next stage; a tied embedding's gradient shards (full
  finetuning);
- all ranks: the loss sum (each TP group's last stage counted once) and the gradient norm.

`parallel.dp=1` is allowed: a (pp, 1, tp) mesh, TP x PP, over which FSDP shards nothing (its
collectives over one rank move no bytes) and every code path still runs; the suite uses it.

Papers: Megatron-LM (1909.08053; 3D in Narayanan et al., 2104.04473); ZeRO (1910.02054);
torchtitan (2410.06511).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module
from transformers import PretrainedConfig

from distft.config import Config
from distft.layout import ParallelDims
from distft.parallel.fsdp_pp import FSDPPipelineParallel
from distft.parallel.pipeline.stages import StageModule
from distft.parallel.tensor_parallel import (
    check_tp_degree,
    head_norms,
    layer_plan,
    partial_gradient_params,
    sum_partial_gradients,
)
from distft.parallel.tp_experts import ExpertShards, Split, split_layers, tagged
from distft.tensors import quiet_redistribute


class FSDPTensorPipelineParallel(ExpertShards, FSDPPipelineParallel):
    name = "fsdp+tp+pp"

    @classmethod
    def validate_model(cls, cfg: Config, model_config: PretrainedConfig) -> None:
        super().validate_model(cfg, model_config)  # enough layers for the stages
        check_tp_degree(cfg, model_config, ParallelDims.of(cls.spec, cfg).tp, knob="parallel.tp=")

    def split_stage(self, module: StageModule) -> None:
        for layer in module.layers.values():  # TP inside each layer, on the innermost dimension
            parallelize_module(layer, self.mesh["tp"], layer_plan(layer))
        self.stage_experts.append((module, *split_layers(module, module.layers.values(), self.mesh["tp"])))

    def parallelize(self, model: nn.Module) -> nn.Module:
        self.stage_experts: list[tuple[StageModule, dict[str, Split], set[str]]] = []  # an MoE's
        view = super().parallelize(model)
        # Looked up after fully_shard, which replaces every parameter by its sharded DTensor.
        layers = [layer for stage in self.stages for layer in stage.submod.layers.values()]
        self.expert_shards = [p for module, splits, _ in self.stage_experts for p in tagged(module, splits)]
        self.expert_mesh = self.mesh["tp"]
        self.partial_grads = partial_gradient_params(head_norms(layers))
        for module, _, partial in self.stage_experts:
            self.partial_grads += [p for name, p in module.named_parameters() if name in partial]
        return view

    def after_backward(self, model: nn.Module) -> None:
        super().after_backward(model)  # a tied embedding's two copies
        # q_norm / k_norm (full finetuning) saw only this rank's heads: sum over the TP group.
        sum_partial_gradients(self.partial_grads, self.mesh["tp"].get_group())

    def reduce_loss(self, local_sum: torch.Tensor) -> torch.Tensor:
        # Every TP rank of a last stage computed the same loss: count one per TP group.
        if self.dims.coordinates(self.env.rank)["tp"] != 0:
            local_sum = torch.zeros_like(local_sum)
        return super().reduce_loss(local_sum)

    def trainable_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        with quiet_redistribute():  # export only: gathering TP-and-FSDP shards logs per dimension
            return super().trainable_state_dict(model)
