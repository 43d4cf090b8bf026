"""Tensor parallelism of a mixture of experts' experts (`tp`, `tp-sp`, and the TP dimension of
`fsdp+tp` and `fsdp+tp+pp`): every TP rank holds every expert, 1/N of each one's intermediate
dimension, as Megatron-LM splits a dense MLP.

transformers holds a layer's experts as two stacks (`Qwen3MoeExperts`): `gate_up_proj`
(E, 2I, hidden), the gate rows of every expert followed by its up rows, and `down_proj`
(E, hidden, I). Rank r of N keeps, for every expert, the features [r I/N, (r+1) I/N):

| tensor                            | shape     | rank r keeps                                  | split          |
|-----------------------------------|-----------|-----------------------------------------------|----------------|
| `gate_up_proj`                    | (E, 2I, h)| its gate rows and the matching up rows        | dim 1, 2 blocks|
| `down_proj`                       | (E, h, I) | the matching columns                          | dim 2          |
| gate_up's lora_B (peft)           | (2I, E r) | the same gate and up rows                     | dim 0, 2 blocks|
| gate_up's lora_A                  | (E r, h)  | all (replicated)                              |                |
| down's lora_A                     | (E r, I)  | the same columns                              | dim 1          |
| down's lora_B                     | (h, E r)  | all (replicated)                              |                |

The two halves of `gate_up_proj` are cut separately and put back together ([gate_r; up_r]), so
transformers' own expert code (eager, grouped_mm or batched_mm, which all split the projection
in two with `chunk(2)`) runs unchanged on the shards and computes silu(gate_r) * up_r, this rank's
features. peft's `ParamWrapper` folds each adapter into its stack before the expert code reads it
(a parametrization, `W + scale B A`, per expert): a rank's shard of B A is (rows of B) A for
gate_up and B (columns of A) for down, so the merged shard is exact with no collective.

Collectives, per MoE layer and micro-batch of T tokens (hooks on the experts module; the router
runs whole, identically on every rank, on the replicated hidden state):
- forward: one all-reduce of the experts' (T, hidden) output, each rank's a partial sum over its
  features, weighted by the router (g);
- backward: the conjugates (f) on the experts' two inputs: an all-reduce of the gradient of the
  (T, hidden) hidden state and of the (T, k) routing weights, each partial on each rank. With the
  routing weights' gradient complete, the router's gradient (its weight, under full finetuning or
  `lora.modules_to_save`, and the hidden state's through it) is the same on every rank and
  complete. (Reducing the whole block's input gradient instead would leave the router weight's
  gradient partial, and sum the auxiliary losses' gradient, whole on every rank, N times.)
- after backward: the replicated adapter factors (gate_up's lora_A, down's lora_B) see only
  this rank's features: their gradients are partial sums, all-reduced with q_norm / k_norm's.
The sharded tensors' gradients are complete for their shard. f and g are DTensor conversions (a
replicated view whose gradient is declared partial; a partial one redistributed to replicated),
as `parallelize_module` makes its own; tp-sp's hand-written pair (`megatron/collectives.py`) is
the same maps, but its package imports `tensor_parallel`, which imports this module.

Checkpoints and export. A rank's gate_up shard is two slices of the stack, not one, which DCP
(one offset per shard) cannot write as such: the shards are plain tensors tagged with their
`Split`, gathered whole (an all-gather each) for the export and for a checkpoint, which holds the
unsplit model's tensors, and cut again on load. A checkpoint therefore loads under any strategy,
and `tp` loads any other's; the price is each expert tensor (and, in full finetuning, its AdamW
moments) whole on every rank while a checkpoint is written.

Under FSDP (`fsdp+tp`, `fsdp+tp+pp`) the slices are cut first; FSDP2 then shards each rank's
slices along the experts over dp like any plain tensor and gathers them for the layer's forward
and backward, so a rank stores 1/(dp N) of every expert. `fully_shard` replaces each parameter by
a new one: the shards are found again by name (`split_layers`, `tagged`). The partial gradients
of the whole adapter factors are all-reduced over TP after FSDP's reduce-scatter, each rank its
dp shard; a checkpoint gathers over dp, then over TP, and loading cuts, then shards.

Paper: Shoeybi et al., "Megatron-LM" (1909.08053), the MLP split; applied per expert.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from peft.tuners.lora.layer import ParamWrapper
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from distft.errors import ConfigError
from distft.parallel.base import Strategy, optimizer_state_owner, unwrap
from distft.parallel.expert_dispatch import experts_base


@dataclass(frozen=True)
class Split:
    """How a rank's slice of an expert tensor is cut: `dim` holds `blocks` equal blocks (gate_up's
    rows: gate, then up), each split N ways; rank r keeps slice r of every block, in order."""

    dim: int
    blocks: int = 1

    def take(self, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        """Rank `rank`'s slice of `full`, a new tensor."""
        blocks = full.detach().unflatten(self.dim, (self.blocks, -1))
        return blocks.chunk(world, self.dim + 1)[rank].flatten(self.dim, self.dim + 1).clone()

    def gather(self, shard: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """The whole tensor from every rank's `shard` (one all-gather; a collective)."""
        blocks = shard.detach().unflatten(self.dim, (self.blocks, -1)).contiguous()
        whole = DTensor.from_local(blocks, mesh, [Shard(self.dim + 1)], run_check=False).full_tensor()
        return whole.flatten(self.dim, self.dim + 1)


# transformers' stacks are (experts, out, in): gate_up's out is [gate; up], down's in is the features.
STACKS = {"gate_up_proj": Split(1, blocks=2), "down_proj": Split(2)}
# peft's factors of each stack: (which one is cut, how; which one stays whole). lora_B is
# (out, experts x r), lora_A (experts x r, in), so gate_up's lora_B is cut on its rows, down's
# lora_A on its columns.
ADAPTERS = {
    "gate_up_proj": ("lora_B", Split(0, blocks=2), "lora_A"),
    "down_proj": ("lora_A", Split(1), "lora_B"),
}


def expert_split(p: torch.Tensor) -> Split | None:
    """How `p` is a TP shard of an expert tensor (None: it is not one)."""
    return getattr(p, "tp_split", None)


def _shard(module: nn.Module, name: str, split: Split, rank: int, world: int) -> nn.Parameter:
    """Replace `module.<name>` by this rank's slice of it, tagged with its `Split`."""
    full = getattr(module, name)
    part = nn.Parameter(split.take(full, rank, world), requires_grad=full.requires_grad)
    part.tp_split = split
    setattr(module, name, part)
    return part


def shard_experts(experts: nn.Module, mesh: DeviceMesh) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Keep this rank's features of every expert in `experts` (transformers' module under peft's
    wrappers, if any), its adapters cut with their stacks, and bracket its forward with f and g.
    Returns (the sharded parameters, the trainable replicated ones whose gradients are partial)."""
    shards, partial = cut_experts(experts, mesh.get_local_rank(), mesh.size())
    experts.register_forward_pre_hook(functools.partial(_enter, mesh=mesh))
    experts.register_forward_hook(functools.partial(_leave, mesh=mesh))
    return shards, partial


def cut_experts(experts: nn.Module, rank: int, world: int) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """`shard_experts` without f and g: `tp-sp` places its collectives at the block's edges
    (`megatron/model.py`)."""
    base = experts_base(experts)
    if base.is_transposed or not base.is_concatenated or base.has_bias or not base.has_gate:
        raise ConfigError(
            f"tensor parallelism splits fused [gate; up] expert stacks without a bias; {type(base).__name__} "
            "holds its experts otherwise: use --strategy fsdp."
        )
    shards = [_shard(base, name, split, rank, world) for name, split in STACKS.items()]
    partial: list[nn.Parameter] = []
    module = experts
    while isinstance(module, ParamWrapper):  # one wrapper per adapted stack, nested
        cut, split, whole = ADAPTERS[module.parameter_name]
        for adapter in module.lora_A:
            shards.append(_shard(getattr(module, cut)[adapter], "weight", split, rank, world))
            partial.append(getattr(module, whole)[adapter].weight)
        module = module.base_layer
    return shards, [p for p in partial if p.requires_grad]


def split_layers(
    model: nn.Module, layers: Iterable[nn.Module], mesh: DeviceMesh
) -> tuple[dict[str, Split], set[str]]:
    """`shard_experts` on every MoE layer of `layers`. Returns the shards' splits and the names of
    the partial-gradient parameters, by name in `model`: FSDP2's `fully_shard` replaces every
    parameter by a new one, so `fsdp+tp` and `fsdp+tp+pp` find them again by name (`tagged`)."""
    cuts = [shard_experts(layer.mlp.experts, mesh) for layer in layers if hasattr(layer.mlp, "experts")]
    shards = [p for layer_shards, _ in cuts for p in layer_shards]
    partial = [p for _, layer_partial in cuts for p in layer_partial]
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(p)]: p.tp_split for p in shards}, {names[id(p)] for p in partial}


def tagged(model: nn.Module, splits: dict[str, Split]) -> list[nn.Parameter]:
    """The parameters of `model` named in `splits`, each tagged with its `Split` (again)."""
    params = dict(model.named_parameters())
    for name, split in splits.items():
        params[name].tp_split = split
    return [params[name] for name in splits]


class ExpertShards:
    """Mixin for the strategies that split every expert along its features (`tp`, `tp-sp`, `fsdp+tp`,
    `fsdp+tp+pp`): the shards' gradients in the norm, and the whole tensors in exports and
    checkpoints. `parallelize` sets `expert_shards` (this rank's, as the model holds them once
    wrapped: plain tensors under `tp` and `tp-sp`, FSDP2's DTensors of them under FSDP) and
    `expert_mesh` (the TP ranks). List it before the strategy class it extends."""

    expert_shards: list[nn.Parameter]
    expert_mesh: DeviceMesh | None = None  # none: a dense model

    def gradient_shares(self, model: nn.Module) -> tuple[list[tuple[torch.Tensor, int]], list[torch.Tensor]]:
        # Each TP rank's shard is a distinct slice: counted on every TP rank, and only as often
        # as its own placements replicate it (never: FSDP's shards of it are distinct too).
        shared, replicated = super().gradient_shares(model)  # type: ignore[misc]
        shards = {id(p.grad) for p in self.expert_shards if p.grad is not None}
        shared = [(g, Strategy.grad_copies(self, g) if id(g) in shards else n) for g, n in shared]  # type: ignore[arg-type]
        shared += [(g, 1) for g in replicated if id(g) in shards]
        return shared, [g for g in replicated if id(g) not in shards]

    def whole_parameter(self, p: torch.Tensor) -> torch.Tensor:
        return whole(p, expert_split(p), self.expert_mesh)  # an expert shard gathered over TP too

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        # Other DTensor shards go to DCP as they are; the experts' shards whole.
        state = super().checkpoint_state(model, optimizer)  # type: ignore[misc]
        return expert_state(state, dict(unwrap(model).named_parameters()), self.expert_mesh, gather=True)

    def load_checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        state = expert_state(state, dict(unwrap(model).named_parameters()), self.expert_mesh, gather=False)
        super().load_checkpoint_state(model, optimizer, state)  # type: ignore[misc]


def whole(t: torch.Tensor, split: Split | None, mesh: DeviceMesh) -> torch.Tensor:
    """The unsplit tensor of `t`: FSDP's shards gathered (a DTensor), then the TP ranks' slices
    (an expert shard: `split` not None); a collective each."""
    full = t.full_tensor() if isinstance(t, DTensor) else t
    return split.gather(full, mesh) if split is not None else full


def copy_in(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """f: identity forward; backward, the sum over the ranks of each one's partial gradient."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def sum_out(y: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """g: the sum over the ranks of each one's partial `y`; backward, identity."""
    return (
        DTensor.from_local(y, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()
    )


def _enter(module: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
    # The MoE block calls experts(hidden (T, h), top_k_index (T, k), top_k_weights (T, k)).
    hidden, top_k_index, top_k_weights = args
    return copy_in(hidden, mesh), top_k_index, copy_in(top_k_weights, mesh)


def _leave(module: nn.Module, args: tuple, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return sum_out(output, mesh)  # (T, h): each rank's features' share of every token's output


def expert_state(state: dict, params: dict[str, nn.Parameter], mesh: DeviceMesh, gather: bool) -> dict:
    """A checkpoint's state (`Strategy.checkpoint_state`: model and flattened optimizer state) with
    every expert shard, and every optimizer tensor of a shard's shape (AdamW's moments), gathered
    whole (`gather`: an all-gather each), or the reverse once a checkpoint is loaded: each whole
    expert tensor cut to this rank's slice. `params`: the model's parameters by name."""
    return {part: {k: _convert(k, v, params, mesh, gather) for k, v in state[part].items()} for part in state}


def _convert(
    key: str, value: object, params: dict[str, nn.Parameter], mesh: DeviceMesh, gather: bool
) -> object:
    # Model keys are parameter names; optimizer keys `state.<name>.exp_avg` (and `param_groups.*`).
    p = params.get(optimizer_state_owner(key)[0] if key.startswith("state.") else key)
    split = expert_split(p) if p is not None else None
    if split is None or not isinstance(value, torch.Tensor) or value.dim() != p.dim():
        return value  # not an expert shard's, or the optimizer's scalar step count
    if gather:
        return whole(value, split, mesh)
    part = split.take(value, mesh.get_local_rank(), mesh.size())
    if isinstance(p, DTensor):  # FSDP2's shards of this rank's slice (`fsdp+tp`): cut locally
        return distribute_tensor(part, p.device_mesh, p.placements, src_data_rank=None)
    return part
