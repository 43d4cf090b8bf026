"""Megatron-style tensor parallelism with sequence parallelism (`tp-sp`), by hand, LoRA built in.

Every rank reads the same batch (no data parallelism). Rank r of N keeps 1/N of each projection of
each decoder layer; a `Linear` weight is (out, in) in torch's convention:

| projection             | base weight split on | lora_A (r, in)  | lora_B (out, r) | rank r computes     |
|------------------------|----------------------|-----------------|-----------------|---------------------|
| q_proj, k_proj, v_proj | out (dim 0)          | replicated      | out (dim 0)     | its H/N query heads and KV/N KV heads |
| gate_proj, up_proj     | out (dim 0)          | replicated      | out (dim 0)     | its slice of the MLP features |
| o_proj                 | in (dim 1)           | in (dim 1)      | replicated      | a partial sum over its heads |
| down_proj              | in (dim 1)           | in (dim 1)      | replicated      | a partial sum over its features |

Replicated on every rank: the (tied) embedding / lm_head and every RMSNorm weight. With sequence
parallelism (SP) the activations *between* blocks are split too: rank r holds positions
[r S/N, (r+1) S/N) of the (S, B, H) residual stream, and the embedding lookup, the residual adds,
input_layernorm, post_attention_layernorm, the final norm and the loss run on that shard only.
Activations run sequence-first, (seq, batch, hidden), as in Megatron-LM, so the sequence is dim 0
and every gather or scatter is a contiguous buffer.

One decoder layer, one micro-batch (N = 2; AG all-gather, RS reduce-scatter, along the sequence):

    x (S/N,B,H) -> norm -> AG -> (S,B,H) -> q,k,v (column) -> attention on H/N heads -> o (row)
      -> partial (S,B,H) -> RS -> (S/N,B,H) -> + x -> norm -> AG -> gate,up (column) -> silu *
      -> down (row) -> partial (S,B,H) -> RS -> (S/N,B,H) -> + x

Forward: 2 all-gathers and 2 reduce-scatters of an (S, B, H) activation per layer. Backward: each
all-gather's adjoint is a reduce-scatter of the input gradient and each reduce-scatter's is an
all-gather of the output gradient: 2 + 2 more (the first block's reduce-scatter is skipped when
nothing before it trains, e.g. LoRA's frozen embeddings). `parallel.sequence_parallel=false` gives
plain Megatron TP for comparison: the same blocks bracketed by f (identity forward, all-reduce
backward) and g (all-reduce forward, identity backward), the residual stream replicated. An
all-reduce moves as many bytes on a ring as a reduce-scatter plus an all-gather, so SP is free in
traffic and divides the memory of everything outside the blocks by N.

LoRA under TP. The adapter is sharded like its base so both paths produce the same layout: a
column layer's lora_A turns the full input into (S, B, r) on every rank and its sharded lora_B
gives this rank's output features. A row layer's sharded lora_A gives a partial (S, B, r) sum and
the replicated lora_B maps it to a partial (S, B, H), added to the base's partial sum *before* the
block's reduce-scatter: B (sum_r A_r x_r) = sum_r B A_r x_r, so the adapter rides the base's
collective. Reducing the adapter's output on its own path instead (all-reducing it, or adding it
after the reduce-scatter) either counts it N times or needs its own sequence-parallel
reduce-scatter; without one its gradient is silently wrong.

Which gradients are partial, and summed over ranks in `after_backward` (one flat all-reduce per
step). Each rank back-propagates its own share of the loss, so a weight's gradient is complete
only if this rank applies it to everything that weight touches:
- sharded weights (every base shard, column lora_B, row lora_A): complete for their shard. A
  column shard sees the full sequence; a row shard receives the full output gradient (from the
  all-gather in backward, or g's identity).
- column lora_A (replicated): partial. Its gradient is dZ^T x with dZ = B_r^T dY_r, the share of
  dZ that flows back through this rank's output features; the full dZ sums over ranks. (DTensor's
  `tp` strategy all-reduces dZ in backward instead; here the gather's reduce-scatter already sums
  the input gradients, so an extra all-reduce of dZ would count the adapter N times.)
- row lora_B (replicated): partial, dY^T (A_r x_r) sees this rank's partial sum only.
- q_norm / k_norm: partial, applied to this rank's heads only.
- with SP, every other replicated weight too (input_layernorm, post_attention_layernorm, the final
  norm, embedding / lm_head in full finetuning): each is applied to this rank's sequence shard.
  Without SP those see the replicated residual stream, whose gradient f's all-reduce makes
  complete: only the four kinds above are partial.
In short: with SP every replicated trainable weight has a partial gradient.

Masking and positions. Attention here is causal only (`is_causal=True`, no padding mask). That is
exact for every labelled position because batches are right-padded (checked per micro-batch) and
labels are pre-shifted with -100 on padding: a real position attends only to earlier positions,
all real, so its output, and thus the loss and every gradient, equals the padding-masked one;
padded positions get garbage but carry no loss and nothing real attends to them. The same holds
for the positions appended so that N divides S (token 0, label -100). Rotary embeddings get the
global position ids 0..S-1 explicitly, computed once per forward (attention runs on the gathered
full sequence, so no rank ever sees shard-local positions).

Checkpoints. `torch.distributed.checkpoint` knows a sharded tensor only as a DTensor; the shards
here are plain tensors under the unsharded names (so that the loop, the gradient norm and the
export stay simple). For save and load only, `checkpoint_state` presents each shard, and its
AdamW moments, as a DTensor with Shard(partition_dim) on a 1-D mesh of the TP ranks, under the
single-model names: each rank writes its own slice and the checkpoint is the unsplit model's.
Per-rank keys (`rank1/q_proj...`) would also have worked, but would tie a checkpoint to one TP
degree and one strategy; as DTensors it reshards like FSDP's.

Papers: Shoeybi et al., "Megatron-LM" (1909.08053); Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models" (2205.05198).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils.checkpoint import checkpoint
from transformers import PretrainedConfig
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from distft.config import Config
from distft.errors import ConfigError
from distft.model import causal_lm, summed_loss
from distft.model.nf4 import TP_REFUSAL
from distft.parallel.base import Batch, Strategy, optimizer_state_owner, unwrap
from distft.parallel.collectives import (
    all_gather_dim,
    copy_to_tp_region,
    gather_from_sp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
)

# The plan, as data: each decoder layer's projections and how their base weights are split.
PLAN: dict[str, str] = {
    "self_attn.q_proj": "column",  # out = query heads: rank r computes heads [r H/N, (r+1) H/N)
    "self_attn.k_proj": "column",  # out = KV heads: exactly those rank r's query heads attend with
    "self_attn.v_proj": "column",
    "self_attn.o_proj": "row",  # in = heads: rank r turns its heads into a partial sum over H
    "mlp.gate_proj": "column",  # out = MLP features: rank r's slice of intermediate_size
    "mlp.up_proj": "column",
    "mlp.down_proj": "row",  # in = MLP features: a partial sum over H
}


def partition_dim(p: torch.Tensor) -> int | None:
    """The dimension a parameter is split along across ranks (None: replicated)."""
    return getattr(p, "partition_dim", None)


def shard(weight: nn.Parameter, dim: int | None, rank: int, world: int) -> nn.Parameter:
    """Rank `rank`'s contiguous slice of `weight` along `dim` (None: the weight itself, replicated).

    The slice is tagged with `partition_dim`, which after_backward, the gradient norm and the
    export read, as Megatron-LM tags its parameters.
    """
    if dim is None:
        return weight
    part = nn.Parameter(weight.detach().chunk(world, dim)[rank].clone(), requires_grad=weight.requires_grad)
    part.partition_dim = dim
    return part


class _Weight(nn.Module):
    """Holds one weight under PEFT's module names (`base_layer`, `lora_A.default`, ...)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight


class ParallelLinear(nn.Module):
    """One rank's shard of a bias-free `nn.Linear`, or of PEFT's LoRA `Linear`, under the same names.

    Parameter names stay those of the single-process model (`q_proj.weight`, or
    `q_proj.base_layer.weight`, `q_proj.lora_A.default.weight`, ...), so exporting is a gather per
    name. No collective runs in here: the decoder layer places them at block boundaries, where
    q/k/v (and gate/up) share one gathered input, one all-gather for three projections.
    """

    weight_dim: ClassVar[int]  # dim of the base weight (out, in) split across ranks
    lora_A_dim: ClassVar[int | None]
    lora_B_dim: ClassVar[int | None]

    def __init__(self, source: nn.Module, rank: int, world: int):
        super().__init__()
        self.lora = hasattr(source, "base_layer")
        if not self.lora:
            self.weight = shard(source.weight, self.weight_dim, rank, world)
            return
        (self.adapter,) = source.active_adapters  # distft applies exactly one adapter
        a = self.adapter
        self.base_layer = _Weight(shard(source.base_layer.weight, self.weight_dim, rank, world))
        self.lora_A = nn.ModuleDict(
            {a: _Weight(shard(source.lora_A[a].weight, self.lora_A_dim, rank, world))}
        )
        self.lora_B = nn.ModuleDict(
            {a: _Weight(shard(source.lora_B[a].weight, self.lora_B_dim, rank, world))}
        )
        self.lora_dropout = source.lora_dropout  # Dropout or Identity: no parameters
        self.scaling = source.scaling[a]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.lora:
            return F.linear(x, self.weight)
        a = self.adapter
        out = F.linear(x, self.base_layer.weight)
        lora = F.linear(F.linear(self.lora_dropout[a](x), self.lora_A[a].weight), self.lora_B[a].weight)
        return out + lora * self.scaling  # PEFT's order of operations, for bit-level parity


# PEFT's adapter export finds adapter weights by walking its tuner layers (an isinstance check),
# not by name. A virtual subclass passes that check without inheriting the tuner layer's
# machinery (its `weight` property would shadow the shard registered under that name).
BaseTunerLayer.register(ParallelLinear)


class ColumnParallelLinear(ParallelLinear):
    """x: (S, B, in), full and replicated -> (S, B, out/N): this rank's output features, complete.

    LoRA: replicated lora_A gives the same (S, B, r) on every rank; lora_B, split on out like the
    base, gives this rank's features of the update.
    """

    weight_dim, lora_A_dim, lora_B_dim = 0, None, 0


class RowParallelLinear(ParallelLinear):
    """x: (S, B, in/N), this rank's input features -> (S, B, out): a partial sum the caller reduces.

    LoRA: lora_A, split on in like the base, gives a partial (S, B, r); replicated lora_B maps it to
    a partial (S, B, out) added to the base's, so one reduction completes both.
    """

    weight_dim, lora_A_dim, lora_B_dim = 1, 1, None


class MegatronLM(nn.Module):
    """The `SummaryLM` (kept as `.module`, where `unwrap` finds it) run as Megatron TP (+ SP).

    The HF submodules (embedding, norms, rotary, q_norm/k_norm, MLP activation) are called as they
    are; only the decoder layer's wiring is written out here, with the collectives in view.
    """

    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup | None,
        sequence_parallel: bool,
        checkpoint_layers: bool = False,
    ):
        super().__init__()
        self.module = module
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.sequence_parallel = sequence_parallel
        self.checkpoint_layers = checkpoint_layers

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Into a block: the full (S, B, H) every rank needs for its column projections."""
        return (
            gather_from_sp_region(x, self.group)
            if self.sequence_parallel
            else copy_to_tp_region(x, self.group)
        )

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """Out of a block: sum the row projection's partial (S, B, H); with SP keep this rank's S/N."""
        if self.sequence_parallel:
            return reduce_scatter_to_sp_region(x, self.group)
        return reduce_from_tp_region(x, self.group)

    def forward(
        self,
        input_ids: torch.Tensor,  # (batch, seq)
        attention_mask: torch.Tensor,  # (batch, seq), 1 for real tokens, right-padded
        labels: torch.Tensor,  # (batch, seq), pre-shifted, -100 where no loss
    ) -> torch.Tensor:
        if (attention_mask[:, 1:] > attention_mask[:, :-1]).any():
            raise ValueError("tp-sp applies a causal mask only, which is exact for right-padded batches only")
        backbone = self.module.backbone
        input_ids, labels = input_ids.t(), labels.t()  # sequence-first: (S, B)
        if self.sequence_parallel:  # N must divide S: append positions that carry no loss
            pad = -input_ids.shape[0] % self.world
            input_ids = F.pad(input_ids, (0, 0, 0, pad), value=0)
            labels = F.pad(labels, (0, 0, 0, pad), value=-100)
        seq = input_ids.shape[0]
        positions = torch.arange(seq, device=input_ids.device).unsqueeze(0)  # global, (1, S)
        cos, sin = backbone.rotary_emb(backbone.embed_tokens.weight, positions)  # (1, S, head_dim)
        if self.sequence_parallel:
            mine = slice(self.rank * seq // self.world, (self.rank + 1) * seq // self.world)
            input_ids, labels = input_ids[mine], labels[mine]
        x = backbone.embed_tokens(input_ids)  # (S/N, B, H): each rank embeds only its own tokens
        for layer in backbone.layers:
            if self.checkpoint_layers:
                # early_stop=False: recompute the whole layer, so its 4 collectives rerun every time
                x = checkpoint(self.layer, layer, x, cos, sin, use_reentrant=False, early_stop=False)
            else:
                x = self.layer(layer, x, cos, sin)
        x = backbone.norm(x)
        return summed_loss(x, self.module.lm_head, labels)  # this rank's tokens' share of the loss

    def layer(self, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One Qwen3 decoder layer. x: (S/N, B, H) with SP, (S, B, H) without."""
        attn, mlp = layer.self_attn, layer.mlp
        h = self.enter(layer.input_layernorm(x))  # (S, B, H)
        seq, batch, _ = h.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # (S, B, n * d) -> (B, n, S, d)
            return t.view(seq, batch, -1, attn.head_dim).permute(1, 2, 0, 3)

        q = heads(attn.q_norm(attn.q_proj(h).view(seq, batch, -1, attn.head_dim)).flatten(2))
        k = heads(attn.k_norm(attn.k_proj(h).view(seq, batch, -1, attn.head_dim)).flatten(2))
        v = heads(attn.v_proj(h))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=attn.attention_dropout if self.training else 0.0,
            is_causal=True,
            scale=attn.scaling,
            enable_gqa=True,  # H/N query heads share KV/N KV heads, the same grouping as unsplit
        )
        o = o.permute(2, 0, 1, 3).reshape(seq, batch, -1)  # (S, B, H/N * d): this rank's heads
        x = x + self.leave(attn.o_proj(o))

        h = self.enter(layer.post_attention_layernorm(x))
        return x + self.leave(mlp.down_proj(mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h)))


def partial_gradient_params(model: nn.Module, sequence_parallel: bool) -> list[nn.Parameter]:
    """Replicated trainable parameters whose gradient each rank computes only in part (docstring)."""
    if sequence_parallel:
        scope = [model]  # every replicated weight sees a sequence shard, its heads or a partial sum
    else:  # inside the blocks only; the replicated residual stream gets complete gradients
        scope = [m for layer in causal_lm(model.lm).model.layers for m in (layer.self_attn, layer.mlp)]
    params = {id(p): p for m in scope for p in m.parameters()}  # tied weights once
    return [p for p in params.values() if p.requires_grad and partition_dim(p) is None]


def saved_activation_bytes(model: nn.Module, batch: Batch) -> int:
    """Bytes autograd keeps for backward in one forward of `model` on `batch`, on this rank.

    Every tensor saved for backward is seen by a saved-tensor hook; tensors sharing a storage
    (views) count once, and parameters and buffers (weights, rotary tables) are not activations.
    """
    exclude = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch)  # kept alive, so no saved storage is freed and its address reused
    del loss
    return sum(storages.values())


class MegatronTPSP(Strategy):
    name = "tp-sp"
    qlora_refusal: ClassVar[str] = TP_REFUSAL
    collectives = "the all-gathers / reduce-scatters of activations (tp-sp)"
    mesh: DeviceMesh | None = None  # only checkpoints use one (DTensor views of the shards)

    @classmethod
    def data_parallel_size(cls, cfg: Config) -> int:
        return 1  # every rank works on the same batch

    @classmethod
    def validate_model(cls, cfg: Config, model_config: PretrainedConfig) -> None:
        n, name = cfg.world_size, cfg.model.name
        heads, kv_heads = model_config.num_attention_heads, model_config.num_key_value_heads
        if heads % n or kv_heads % n:
            fits = next(d for d in range(n, 0, -1) if heads % d == 0 and kv_heads % d == 0)
            raise ConfigError(
                f"--strategy {cls.name} splits attention heads across {n} ranks, but {name} has {heads} "
                f"query heads and {kv_heads} KV heads; the TP degree must divide both (e.g. --nproc {fits})."
            )
        if model_config.intermediate_size % n:
            raise ConfigError(
                f"--strategy {cls.name} splits the MLP across {n} ranks, but {name}'s intermediate_size "
                f"{model_config.intermediate_size} is not divisible by {n}."
            )
        if getattr(model_config, "attention_bias", False):
            raise ConfigError(f"--strategy {cls.name} supports bias-free projections only (attention_bias).")
        if set(getattr(model_config, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
            raise ConfigError(f"--strategy {cls.name} supports full attention only (no sliding window).")

    def parallelize(self, model: nn.Module) -> nn.Module:
        rank, world = self.env.rank, self.env.world_size
        for layer in causal_lm(model.lm).model.layers:  # split on the CPU: the device gets shards only
            for path, style in PLAN.items():
                parent_path, name = path.rsplit(".", 1)
                parent = layer.get_submodule(parent_path)
                cls = ColumnParallelLinear if style == "column" else RowParallelLinear
                setattr(parent, name, cls(getattr(parent, name), rank, world))
        model.to(self.env.device)
        self.sequence_parallel = self.cfg.parallel.sequence_parallel
        self.partial_grads = partial_gradient_params(model, self.sequence_parallel)
        return MegatronLM(model, None, self.sequence_parallel, self.cfg.model.activation_checkpointing)

    def after_backward(self, model: nn.Module) -> None:
        grads = [p.grad for p in self.partial_grads if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective for all of them
        dist.all_reduce(flat)
        for g, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(summed.view_as(g))

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> float:
        """As `Strategy.clip_grad_norm_` (float64 squares), for plain-tensor shards: sharded gradients
        are summed over ranks, replicated ones (equal on every rank after after_backward) counted once."""
        params = [p for p in model.parameters() if p.grad is not None]
        sharded = torch.zeros((), dtype=torch.float64, device=self.env.device)
        replicated = torch.zeros_like(sharded)
        for p in params:
            square = torch.linalg.vector_norm(p.grad, dtype=torch.float64) ** 2
            if partition_dim(p) is None:
                replicated += square
            else:
                sharded += square
        dist.all_reduce(sharded)
        norm = (sharded + replicated).sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as torch.nn.utils.clip_grad_norm_
            for p in params:
                p.grad.mul_(coef.to(p.grad.dtype))
        return float(norm)

    def reduce_loss(self, local_sum: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return local_sum  # every rank computed the whole loss
        local_sum = local_sum.clone()
        dist.all_reduce(local_sum)  # each rank's share: the loss over its sequence shard
        return local_sum

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The checkpoint of the unsplit model, each rank writing its shards (module docstring).

        A shard here is a plain tensor under the unsharded name; handed to DCP as is, it would be
        taken for a replica, and only rank 0's slice written. Instead each shard (and its AdamW
        moments, which have its shape) is wrapped as a DTensor placed Shard(partition_dim) on a
        1-D mesh of the TP ranks, which describes exactly what it is: one slice of the full
        tensor. Keys are the inner `SummaryLM`'s, as for every other strategy, so the checkpoint
        loads at another TP degree or into another strategy (DCP reshards on load). The wrap
        shares storage, so loading into it writes the shards in place.
        """
        from torch.distributed.tensor import DTensor, Shard

        inner = unwrap(model)  # the same Parameters, without MegatronLM's `module.` prefix
        state = super().checkpoint_state(inner, optimizer)
        params = dict(inner.named_parameters())
        if self.mesh is None:  # all TP ranks (the default group), made on first use
            self.mesh = init_device_mesh(self.env.device.type, (self.env.world_size,), mesh_dim_names=("tp",))

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

    def load_checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        from torch.distributed.tensor import DTensor

        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if isinstance(t, DTensor) else t

        state = {part: {k: local(v) for k, v in state[part].items()} for part in ("model", "optim")}
        super().load_checkpoint_state(unwrap(model), optimizer, state)

    def trainable_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Trainable weights under the single-model names, shards gathered (a collective each), on rank 0."""
        state = {}
        for name, param in unwrap(model).lm.named_parameters():
            if param.requires_grad:
                dim = partition_dim(param)
                full = param.detach() if dim is None else all_gather_dim(param, dim)
                if self.env.is_main:
                    state[name] = full.cpu().clone()
        return state if self.env.is_main else None

    def expected_comm_bytes(self, model: nn.Module, batches: list[Batch]) -> dict[str, int]:
        """Analytic bytes per optimizer step, in `distft.measure.comm`'s convention (full logical tensors).

        Per micro-batch and layer, 2 block entries and 2 exits, each of an (S, B, H) activation, S
        padded to a multiple of N with SP: forward always; an entry's backward only if its input
        needs a gradient (something before it trains), an exit's only if its block's output does;
        a checkpointed layer runs its forward collectives again in backward. Plus one all-reduce of
        the partial gradients, the loss (SP) and the gradient norm.
        """
        lm = causal_lm(unwrap(model).lm)
        hidden, n = lm.config.hidden_size, self.env.world_size
        lora = self.cfg.train.method == "lora"
        targets = set(self.cfg.lora.target_modules) if lora else set()
        blocks = [
            {path.rsplit(".", 1)[1] for path in PLAN if path.startswith(p)} for p in ("self_attn", "mlp")
        ]

        needs_grad = not lora  # full finetuning: the embeddings train
        enters_bwd = leaves_bwd = recomputed = 0
        for _ in lm.model.layers:
            for block in blocks:
                enters_bwd += needs_grad
                needs_grad = needs_grad or bool(block & targets)
                leaves_bwd += needs_grad
            recomputed += needs_grad and self.cfg.model.activation_checkpointing
        enters = leaves = 2 * len(lm.model.layers) + 2 * recomputed

        model_size = next(lm.parameters()).element_size()
        autocast = self.cfg.model.autocast and self.env.device.type == "cuda"
        compute_size = 2 if autocast else model_size  # projection outputs are bf16 under autocast
        tokens = 0
        for b in batches:
            batch, seq = b["input_ids"].shape
            tokens += batch * (seq + (-seq % n if self.sequence_parallel else 0))
        # Entries carry norm outputs (model dtype) forward and their gradients back; exits carry
        # projection outputs (compute dtype), and their gradients back.
        enter_bytes = tokens * hidden * model_size
        leave_bytes = tokens * hidden * compute_size
        partial = sum(p.numel() * p.element_size() for p in self.partial_grads)
        scalars = 8 + (4 if self.sequence_parallel else 0)  # float64 grad-norm square sum, fp32 loss
        if not self.sequence_parallel:
            return {"all_reduce": leave_bytes * leaves + enter_bytes * enters_bwd + partial + scalars}
        return {
            "all_gather": enter_bytes * enters + leave_bytes * leaves_bwd,
            "reduce_scatter": leave_bytes * leaves + enter_bytes * enters_bwd,
            "all_reduce": partial + scalars,
        }
