"""2D parallelism (`fsdp+tp`): FSDP across one mesh dimension, tensor parallelism inside the other.

The ranks form a (dp, tp) `DeviceMesh` (`distft.layout.ParallelDims`, tp the inner,
neighbouring ranks). Each TP group of `tp` ranks is one model replica split by tensor parallelism
and reads one data-parallel shard of the global batch; FSDP shards each rank's TP slice across the
`dp` ranks that hold the same slice. Built as torchtitan does: TP first (the plan and LoRA
treatment of `tensor_parallel.py`), then FSDP2 `fully_shard(..., mesh=mesh["dp"])` per decoder
layer and root (`fsdp.shard_units`), which turns every parameter into a DTensor on the 2D mesh.

What each rank holds, with dp = tp = 2 (rank = 2 dp_index + tp_index):
- of a column-parallel projection (q, k, v, gate, up: out/tp rows per TP rank) and its lora_B:
  half of this TP rank's rows, i.e. 1/(dp tp) of the weight;
- of a row-parallel projection (o, down: in/tp columns per TP rank) and its lora_A: half of the rows
  of this TP rank's columns, again 1/(dp tp);
- of everything TP replicates (embeddings / tied lm_head, norms, column lora_A, row lora_B):
  1/dp, the same shard as the other rank of its TP group;
- the gradients and AdamW state of its shards only;
- activations of its data shard, with attention heads and MLP features split by tp;
- of a mixture of experts' expert stacks, 1/(dp tp): tp cuts every expert's intermediate
  features (`tp_experts`, as under `tp`), FSDP shards those slices along the experts. Their
  collectives are `tp`'s experts' (one all-reduce of the experts' output forward, of their
  inputs' gradients backward) over tp, beside FSDP's gathers of the slices over dp.

Which collectives run on which dimension (per micro-batch):
- dp (FSDP, groups {0, 2} and {1, 3}): all-gather of each layer's TP-local parameters before its
  forward and again before its backward (ZeRO-3), reduce-scatter of its adapter gradients after
  its backward; the loss sum is all-reduced over dp too (TP ranks share one loss);
- tp (groups {0, 1} and {2, 3}): tensor parallelism's activation all-reduces, 2 per layer forward
  after the row projections (+ 2 rank-r ones for LoRA) and one per column projection's input in
  backward; with full finetuning also q_norm / k_norm's partial gradients (`after_backward`);
- the whole mesh: the gradient norm's float64 sum of squares (one scalar).
So the heavy, per-layer activation traffic stays inside a TP group (one node, fast links) and the
weight traffic of FSDP crosses groups, each moving 1/tp of what 1D FSDP would.

Batch accounting: the global batch splits into dp shards (not dp x tp): `data_parallel_size` is
dp, a rank's data shard is its dp coordinate, and both ranks of a TP group run the same
micro-batches.

Papers: Megatron-LM (1909.08053) for TP; ZeRO (1910.02054) and PyTorch FSDP (2304.11277);
torchtitan (2410.06511) for the 2D composition.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from transformers import PretrainedConfig

from distft.config import Config
from distft.errors import ConfigError
from distft.layout import ParallelDims
from distft.model import causal_lm
from distft.parallel.base import Strategy, summed
from distft.parallel.dims import build_mesh
from distft.parallel.fsdp import FSDP, shard_units
from distft.parallel.tensor_parallel import (
    check_tp_degree,
    head_norms,
    layer_plan,
    partial_gradient_params,
    sum_partial_gradients,
)
from distft.parallel.tp_experts import ExpertShards, split_layers, tagged
from distft.tensors import quiet_redistribute


class FSDPTensorParallel(ExpertShards, Strategy):
    name = "fsdp+tp"

    @classmethod
    def validate_config(cls, cfg: Config) -> None:
        FSDP.validate_config(cfg)  # the fsdp_* settings apply to the dp dimension
        dims = ParallelDims.of(cls.spec, cfg)
        if dims.pp != 1:
            raise ConfigError(
                "parallel.pp is reserved for pipeline strategies (ddp+pp, fsdp+pp, fsdp+tp+pp for 3D); --strategy "
                f"{cls.name} takes parallel.dp and parallel.tp only."
            )
        if dims.tp < 2:
            plain = "hsdp" if cls.spec.shard_groups else "fsdp"
            raise ConfigError(
                f"--strategy {cls.name} needs parallel.tp of 2 or more (it is {dims.tp}); with one TP rank it "
                f"is plain {plain}: use --strategy {plain}, or e.g. --nproc {cfg.parallel.nproc} parallel.tp=2."
            )

    @classmethod
    def validate_model(cls, cfg: Config, model_config: PretrainedConfig) -> None:
        check_tp_degree(cfg, model_config, ParallelDims.of(cls.spec, cfg).tp, knob="parallel.tp=")

    def parallelize(self, model: nn.Module) -> nn.Module:
        model.to(self.env.device)
        self.mesh, self.flattened = build_mesh(self.spec, self.dims, self.env.device.type)
        layers = list(causal_lm(model.lm).model.layers)
        for layer in layers:  # 1. TP inside each layer, on the inner dimension
            parallelize_module(layer, self.mesh["tp"], layer_plan(layer))
        splits, partial = split_layers(model, layers, self.mesh["tp"])  # an MoE's experts
        shard_units(model, layers, self.data_mesh(), self.cfg, reshard_after_forward=True)  # 2. FSDP over dp
        # Looked up after fully_shard, which replaces every parameter by its sharded DTensor.
        self.expert_shards, self.expert_mesh = tagged(model, splits), self.mesh["tp"]
        self.partial_grads = partial_gradient_params(head_norms(layers))
        self.partial_grads += [p for name, p in model.named_parameters() if name in partial]
        return model

    def after_backward(self, model: nn.Module) -> None:
        # q_norm / k_norm (full finetuning) saw only this rank's heads: sum over the TP group.
        # FSDP has already averaged them over dp; each rank adds up its own dp shard.
        sum_partial_gradients(self.partial_grads, self.mesh["tp"].get_group())

    def grad_copies(self, g: DTensor) -> int:
        # A parameter TP replicates lives on the dp sub-mesh only; each TP rank holds a copy.
        return super().grad_copies(g) * (self.env.world_size // g.device_mesh.size())

    def trainable_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        with quiet_redistribute():  # export only: gathering TP-and-FSDP shards logs per dimension
            return super().trainable_state_dict(model)

    def reduce_loss(self, local_sum: torch.Tensor) -> torch.Tensor:
        if self.dims.dp == 1:
            return local_sum  # one data shard: every rank computed the whole loss
        # Each TP group computed the loss of its data shard once.
        data = self.flattened["dp"] if "dp" in self.flattened else self.mesh["dp"]  # HSDP x TP: flattened
        return summed(local_sum, group=data.get_group())

    def data_mesh(self) -> DeviceMesh:
        """The data-parallel ranks FSDP2 shards over ("dp"; HSDP x TP: its 2D "replicate" x "shard")."""
        return self.mesh["dp"]
