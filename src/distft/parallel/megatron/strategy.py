"""`tp-sp`: the Megatron TP (+ SP) strategy: what is sharded, which gradients are partial, checkpoints.

Every rank reads the same batch (no data parallelism). Sharded: each decoder layer's projections
(`layers.py`), and with sequence parallelism the residual stream between blocks (`model.py`).
Replicated: the (tied) embedding / lm_head and every RMSNorm weight.

Collectives. Forward and backward: the activations' all-gathers / reduce-scatters (SP) or
all-reduces (plain TP) at block boundaries (`model.py`). After backward: one flat all-reduce of
the partial gradients. Per step: the gradient norm's float64 sum of squares (the base
`Strategy.clip_grad_norm_`, fed by `gradient_shares`) and, with SP, the loss sum.

Which gradients are partial, and summed over ranks in `after_backward`. Each rank back-propagates
its own share of the loss, so a weight's gradient is complete only if this rank applies it to
everything that weight touches:
- sharded weights (every base shard, column lora_B, row lora_A): complete for their shard. A
  column shard sees the full sequence; a row shard receives the full output gradient (from the
  all-gather in backward, or g's identity).
- column lora_A (replicated): partial. Its gradient is dZ^T x with dZ = B_r^T dY_r, the share of
  dZ that flows back through this rank's output features; the full dZ sums over ranks. (DTensor's
  `tp` strategy all-reduces dZ in backward instead; here the gather's reduce-scatter already sums
  the input gradients, so an extra all-reduce of dZ would count the adapter N times.)
- row lora_B (replicated): partial, dY^T (A_r x_r) sees this rank's partial sum only.
- q_norm / k_norm: partial, applied to this rank's heads only.
- a mixture of experts' expert shards (`tp_experts`): complete for their shard, as the base
  shards; gate_up's lora_A and down's lora_B, whole on every rank: partial, like column lora_A
  and row lora_B.
- with SP, every other replicated weight too (input_layernorm, post_attention_layernorm, the final
  norm, embedding / lm_head in full finetuning, an MoE's router, which routes this rank's
  positions): each is applied to this rank's sequence shard. Without SP those see the replicated
  residual stream, whose gradient f's all-reduce makes complete (the router reads it ahead of
  f): only the kinds above are partial.
In short: with SP every replicated trainable weight has a partial gradient.

Checkpoints. `torch.distributed.checkpoint` knows a sharded tensor only as a DTensor; the shards
here are plain tensors under the unsharded names (so that the loop, the gradient norm and the
export stay simple). For save and load only, `checkpoint_state` presents each shard, and its
AdamW moments, as a DTensor with Shard(partition_dim) on a 1-D mesh of the TP ranks, under the
single-model names: each rank writes its own slice and the checkpoint is the unsplit model's.
Per-rank keys (`rank1/q_proj...`) would also have worked, but would tie a checkpoint to one TP
degree and one strategy; as DTensors it reshards like FSDP's. An MoE's expert shards, two
slices of their stack each, which no single placement describes, are written whole instead
(`tp_experts.ExpertShards`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from transformers import PretrainedConfig

from distft.config import Config
from distft.errors import ConfigError
from distft.model import causal_lm
from distft.parallel.base import Strategy, optimizer_state_owner, summed, unwrap
from distft.parallel.dims import build_mesh
from distft.parallel.grads import all_reduce_flat
from distft.parallel.megatron.collectives import all_gather_dim
from distft.parallel.megatron.layers import shard_projections
from distft.parallel.megatron.model import MegatronLM
from distft.parallel.tensor_parallel import check_tp_degree, partial_gradient_params, partition_dim
from distft.parallel.tp_experts import ExpertShards
from distft.tensors import local


class TensorSequenceParallel(ExpertShards, Strategy):
    name = "tp-sp"
    mesh: DeviceMesh | None = None  # only checkpoints use one (DTensor views of the shards)

    @classmethod
    def validate_model(cls, cfg: Config, model_config: PretrainedConfig) -> None:
        check_tp_degree(cfg, model_config, cfg.world_size, knob="--nproc ")
        if getattr(model_config, "attention_bias", False):
            raise ConfigError(f"--strategy {cls.name} supports bias-free projections only (attention_bias).")
        if set(getattr(model_config, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
            raise ConfigError(f"--strategy {cls.name} supports full attention only (no sliding window).")
        if cfg.model.activation_checkpointing == "selective" or cfg.model.mlp_tiles > 1:
            raise ConfigError(
                f"--strategy {cls.name} recomputes whole layers, collectives included: set "
                "model.activation_checkpointing=full or offload (selective, model.mlp_tiles: the other strategies)."
            )

    def parallelize(self, model: nn.Module) -> nn.Module:
        # On the CPU: the device gets shards.
        self.expert_shards = shard_projections(model.lm, self.env.rank, self.env.world_size)
        model.to(self.env.device)
        if self.expert_shards:  # an MoE's shards are gathered whole over it (`tp_experts`)
            self.expert_mesh = self.mesh = self.tp_mesh()
        self.sequence_parallel = self.cfg.parallel.sequence_parallel
        if self.sequence_parallel:
            scope = [model]  # every replicated weight sees a sequence shard, its heads or a partial sum
        else:  # inside the blocks only; the replicated residual stream gets complete gradients,
            # as does a router, which routes it before f (`MegatronLM.experts`)
            layers = causal_lm(model.lm).model.layers
            scope = [
                m for layer in layers for m in (layer.self_attn, getattr(layer.mlp, "experts", layer.mlp))
            ]
        self.partial_grads = partial_gradient_params(scope)
        return MegatronLM(model, None, self.sequence_parallel, self.cfg.model.activation_checkpointing)

    def after_backward(self, model: nn.Module) -> None:
        all_reduce_flat([p.grad for p in self.partial_grads if p.grad is not None])  # one collective

    def gradient_shares(self, model: nn.Module) -> tuple[list[tuple[torch.Tensor, int]], list[torch.Tensor]]:
        """Shards (plain tensors with a `partition_dim`, and an MoE's expert shards: `ExpertShards`)
        are summed over the TP ranks, one copy each; replicated gradients, equal on every rank
        after `after_backward`, are counted once."""
        shared, replicated = super().gradient_shares(model)
        shards = {id(p.grad) for p in model.parameters() if partition_dim(p) is not None}
        shared += [(g, 1) for g in replicated if id(g) in shards]
        return shared, [g for g in replicated if id(g) not in shards]

    def reduce_loss(self, local_sum: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return local_sum  # every rank computed the whole loss
        return summed(local_sum)  # each rank's share: the loss over its sequence shard

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The checkpoint of the unsplit model, each rank writing its shards (module docstring).

        A shard here is a plain tensor under the unsharded name; handed to DCP as is, it would be
        taken for a replica, and only rank 0's slice written. Instead each shard (and its AdamW
        moments, which have its shape) is wrapped as a DTensor placed Shard(partition_dim) on a
        1-D mesh of the TP ranks, which describes exactly what it is: one slice of the full
        tensor. Keys are the inner `LossLM`'s, as for every other strategy, so the checkpoint
        loads at another TP degree or into another strategy (DCP reshards on load). The wrap
        shares storage, so loading into it writes the shards in place.
        """
        inner = unwrap(model)  # the same Parameters, without MegatronLM's `module.` prefix
        state = super().checkpoint_state(inner, optimizer)
        params = dict(inner.named_parameters())
        self.mesh = self.mesh or self.tp_mesh()  # made on first use

        def wrap(name: str, t: torch.Tensor) -> torch.Tensor:
            p = params.get(name)
            dim = partition_dim(p) if p is not None else None
            if dim is None or not isinstance(t, torch.Tensor) or t.shape != p.shape:
                return t  # replicated, or the optimizer's scalar step count
            return DTensor.from_local(t, self.mesh, [Shard(dim)], run_check=False)

        state["model"] = {k: wrap(k, v) for k, v in state["model"].items()}
        state["optim"] = {  # flattened: `state.<fqn>.exp_avg` has the parameter's shape
            k: wrap(optimizer_state_owner(k)[0], v) if k.startswith("state.") else v
            for k, v in state["optim"].items()
        }
        return state

    def tp_mesh(self) -> DeviceMesh:
        """A 1-D mesh of the TP ranks (the default group)."""
        return build_mesh(self.spec, self.dims, self.env.device.type)[0]

    def load_checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        state = {part: {k: local(v) for k, v in state[part].items()} for part in ("model", "optim")}
        super().load_checkpoint_state(unwrap(model), optimizer, state)

    def whole_parameter(self, p: torch.Tensor) -> torch.Tensor:
        """A shard gathered (a collective each), for the base class's `trainable_state_dict`."""
        dim = partition_dim(p)  # None: replicated, or an MoE's expert shard (`ExpertShards`)
        return all_gather_dim(p, dim) if dim is not None else super().whole_parameter(p)
