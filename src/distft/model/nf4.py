"""QLoRA's 4-bit base: NF4 weights (torchao's `NF4Tensor`) that FSDP2 can shard, and their bytes.

`--method qlora` stores every projection of every decoder layer (q, k, v, o, gate, up, down) as
4-bit NormalFloat (Dettmers et al., "QLoRA", 2305.14314) and trains LoRA adapters in the model
dtype on top. Embeddings (tied to lm_head in Qwen3) and norms stay in the model dtype, as in
QLoRA and bitsandbytes. The forward dequantizes one weight at a time (`distft.model.nf4_linear`:
torchao's arithmetic, fused into one compiled kernel on CUDA), so compute and the adapters'
gradients are in the model dtype.

Layout of one weight of n elements (block B = `model.quant_block_size`, 64; group G =
`model.quant_scaler_block_size`, 256, lowered for small weights by `NF4Spec.group_size`; s = model
dtype bytes):

| tensor                | dtype    | elements   | what                                                   |
|-----------------------|----------|------------|--------------------------------------------------------|
| `quantized_data`      | uint8    | n / 2      | two 4-bit codes per byte, row-major                    |
| `quantized_scalers`   | int8     | n / B      | each block's absmax, minus their mean, 8-bit (double quant) |
| `quantization_factor` | s        | n / (B G)  | one scale per group of G block absmaxes                |
| `scaler_mean`         | s        | 1          | the mean subtracted from the absmaxes                  |
| `nf4`                 | s        | 16         | the NF4 code book (a copy per tensor)                  |

so 0.5 + 1/B + s/(B G) bytes per element plus 17 s bytes per tensor: 0.515869 bytes per element
in an fp32 model (the planner's 0.5 + 1/64 + 4/16384), 0.515747 in bf16 (torchao keeps the group
scale in the model dtype). `model.double_quant=false` keeps each
absmax in the model dtype instead (`quantized_scalers` becomes n / B values of s bytes, the factors
become ones, the mean zero): 0.5 + s/B + s/(B G) per element. `storage_layout` measures what a
model (or one rank's shard of it) actually holds; `nf4_bytes` is the formula.

Why QLoRA and FSDP usually do not mix. FSDP treats every parameter as a dense tensor of its
dtype: it splits it along dim 0 (FSDP2) or flattens a unit's parameters into one buffer (FSDP1),
all-gathers the pieces before use and reduce-scatters gradients. bitsandbytes' `Params4bit` is
not such a tensor: the 4-bit codes are packed into a uint8 tensor of another shape, and the
absmaxes, the double-quantization state and the original shape live in a Python `quant_state`
object beside it. FSDP can move the packed bytes but neither shards nor gathers the quant_state,
so a gathered weight has no scales (or the wrong ones), and its uint8 storage cannot share FSDP1's
flat buffer with bf16 parameters. (The known bitsandbytes route stores the codes in a bf16
`quant_storage` so FSDP1 can flatten them with the rest, and keeps the quant state whole on
every rank.)

What makes it work here. torchao's NF4Tensor is a tensor subclass whose codes, block scales and
group factors are all inner tensors, laid out so that a dim-0 chunk of the weight is a chunk of
each of them, and it implements what FSDP2 needs: `torch.chunk`/`split` along dim 0 (sharding at
`fully_shard`), `new_zeros`/`copy_`/`view` (the padded shard), and the `fsdp_pre_all_gather` /
`fsdp_post_all_gather` extension points: FSDP2 all-gathers the three inner tensors (as bytes, in
the same collective as the unit's LoRA weights) and rebuilds a full NF4Tensor from them, carrying
the per-tensor mean and code book as metadata. The gathered tensor is bit-identical to the one a
single process quantized, so FSDP-QLoRA trains exactly like one process. The conditions, checked
before launch (`check_quantizable`): each weight's rows divide by the FSDP degree (NF4 cannot be
padded) and so does its number of scale groups (a shard holds whole groups). `group_size` cuts a
weight too small for whole groups of G into a multiple of 8 groups, so with the defaults FSDP over
2, 4 or 8 ranks fits the tiny presets too; past that the error names the
`model.quant_scaler_block_size` that fits, or says that none does. The frozen 4-bit
base has no gradient, so reduce-scatters carry only the adapters' gradients, as with LoRA.

Traps met on the way, handled here:
- DDP broadcasts every parameter from rank 0 at construction; NF4Tensor implements that
  broadcast's `copy_` by re-quantizing the dequantized weight, so every rank silently ends up with
  a slightly different base (1e-5 relative in the loss). Every rank quantizes the same seeded
  weights identically, so the NF4 weights are left out of DDP (`nf4_parameter_names`).
- Tensor parallelism splits o_proj and down_proj along dim 1 (row-parallel); NF4Tensor splits only
  along dim 0 (`aten.split(NF4Tensor, dim=1)` is not implemented: its blocks run along rows in
  memory), so QLoRA with tp, tp-sp and fsdp+tp is refused before launch.
- Importing torchao on CPU logs a warning per CUDA extension it cannot load (and transformers
  imports it whenever it is installed): `distft/__init__.py` quiets its logger.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from distft.config import ModelConfig
from distft.errors import ConfigError
from distft.model.nf4_linear import NF4Linear
from distft.tensors import local

NF4_CODES = 16  # entries of the code book stored with each tensor
INNER = ("quantized_data", "quantized_scalers", "quantization_factor")  # what FSDP2 shards and gathers
META = ("scaler_mean", "nf4")  # replicated with every shard
# Scale groups per weight are kept a multiple of this (where the weight's block count allows), so
# FSDP over 1, 2, 4 or 8 ranks (a node) gives each rank whole groups whatever the model size.
SHARDABLE_GROUPS = 8


@functools.cache
def nf4_api():
    """torchao's NF4 module (pure PyTorch), imported without its warnings (see distft/__init__.py)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:  # pragma: no cover - torchao is a dependency
        raise ConfigError("--method qlora needs torchao (pip install 'torchao==0.18.*').") from None
    return nf4_tensor


@dataclass(frozen=True)
class NF4Spec:
    block_size: int = 64
    """Weights per block; each block stores its absmax."""
    scaler_block_size: int = 256
    """Blocks per double-quantization group (capped to a weight's block count, see `group_size`)."""
    double_quant: bool = True
    """8-bit absmaxes with a scale per group; false: absmaxes in the model dtype."""

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> NF4Spec:
        return cls(cfg.quant_block_size, cfg.quant_scaler_block_size, cfg.double_quant)

    def group_size(self, numel: int) -> int:
        """Blocks per scale group for a weight of `numel` elements. The configured size when it
        divides the weight's block count (every real Qwen3 projection: the QLoRA layout the planner
        assumes); for a smaller or uneven weight, the largest divisor of it that cuts the blocks
        into a multiple of `SHARDABLE_GROUPS` groups (or of as large a divisor of 8 as the block
        count allows), so FSDP over 2, 4 or 8 ranks hands each rank whole groups with the defaults.
        The size does not depend on the rank count: every strategy quantizes a weight the same way."""
        blocks = numel // self.block_size
        if blocks % self.scaler_block_size == 0:
            return self.scaler_block_size
        step = math.gcd(blocks, SHARDABLE_GROUPS)
        largest = math.gcd(self.scaler_block_size, blocks)
        return next(g for g in range(largest, 0, -1) if largest % g == 0 and (blocks // g) % step == 0)

    def to_dict(self) -> dict:
        return {"format": "nf4", **self.__dict__}


def is_nf4(t: torch.Tensor) -> bool:
    t = local(t)
    return "NF4Tensor" in type(t).__name__ and hasattr(t, "quantized_data")


def quantize(weight: torch.Tensor, spec: NF4Spec) -> torch.Tensor:
    """`weight` (out, in) as an NF4Tensor of the same shape and outer dtype."""
    nf4 = nf4_api()
    weight = weight.detach().contiguous()
    q = nf4.NF4Tensor.from_tensor(weight, spec.block_size, spec.group_size(weight.numel()))
    if spec.double_quant:
        return q
    # Single quantization: keep each block's absmax exactly, in the model dtype. The container
    # stays torchao's (so FSDP2 shards it the same way); unit factors and a zero mean make its
    # dequantization `scalers / 1 + 0` exact.
    absmax = weight.flatten().view(-1, spec.block_size).abs().amax(dim=1)
    return nf4.NF4Tensor(
        nf4.SubclassTensorArgs(weight.size(), weight.stride(), 0, weight.dtype, weight.device, False),
        q.block_size,
        q.n_blocks,
        q.scaler_block_size,
        absmax,
        torch.ones_like(q.quantization_factor),
        torch.zeros_like(q.scaler_mean),
        q.quantized_data,
        q.nf4,
    )


def quantized_linears(layers: nn.ModuleList) -> list[tuple[str, nn.Linear]]:
    """Every projection inside these decoder layers (attention and MLP), by name."""
    return [
        (f"layers.{i}.{name}", module)
        for i, layer in enumerate(layers)
        for name, module in layer.named_modules()
        if isinstance(module, nn.Linear)
    ]


@torch.no_grad()
def quantize_base(layers: nn.ModuleList, spec: NF4Spec) -> None:
    """Replace each projection's weight in these decoder layers with a frozen NF4 parameter, in
    place, and make the projection an `NF4Linear` (its dequantisation can be compiled)."""
    for _, linear in quantized_linears(layers):
        linear.weight = nn.Parameter(quantize(linear.weight, spec), requires_grad=False)
        linear.__class__ = NF4Linear


@torch.no_grad()
def dequantize_base(layers: nn.ModuleList, spec: NF4Spec) -> None:
    """The base a QLoRA adapter was trained on, as plain weights: each projection of these decoder
    layers quantized and dequantized, in place. Load the adapter on this (`PeftModel.from_pretrained`)
    to reproduce the trained model without torchao at inference time."""
    for _, linear in quantized_linears(layers):
        w = linear.weight
        q = w if is_nf4(w) else quantize(w, spec)
        linear.weight = nn.Parameter(q.get_original_weight().to(w.dtype), requires_grad=False)
        linear.__class__ = nn.Linear


QUANTIZATION_FILE = "quantization.json"  # beside a QLoRA adapter: how to rebuild its base


def quantization(cfg) -> dict | None:
    """What `QUANTIZATION_FILE` records for a run (None unless --method qlora)."""
    if cfg.train.method != "qlora":
        return None
    return {**NF4Spec.from_config(cfg.model).to_dict(), "modules": "every nn.Linear in the decoder layers"}


def nf4_parameter_names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if is_nf4(p)]


# ---------------------------------------------------------------------------------------------
# Bytes
# ---------------------------------------------------------------------------------------------


def nf4_bytes(numel: int, spec: NF4Spec, itemsize: int = 4, shards: int = 1) -> dict[str, int]:
    """The storage of one weight of `numel` elements, by inner tensor, on one of `shards` FSDP
    ranks; `itemsize` is the model dtype's (4 fp32, 2 bf16). Matches `storage_layout` exactly."""
    blocks = numel // spec.block_size
    groups = blocks // spec.group_size(numel)
    return {
        "quantized_data": numel // 2 // shards,
        "quantized_scalers": blocks // shards * (1 if spec.double_quant else itemsize),
        "quantization_factor": groups // shards * itemsize,
        "scaler_mean": itemsize,  # every shard carries the per-tensor metadata
        "nf4": NF4_CODES * itemsize,
    }


def storage_layout(model: nn.Module) -> dict[str, int]:
    """Bytes of parameters this rank holds, by kind: the NF4 inner tensors one by one, and
    `dense` for every other parameter (embeddings, norms, adapters); sharded parameters
    (DTensors: FSDP, TP) count their local shard only."""
    layout = dict.fromkeys((*INNER, *META, "dense"), 0)
    for p in model.parameters():
        shard = local(p)
        if is_nf4(p):
            for name in (*INNER, *META):
                inner = getattr(shard, name)
                layout[name] += inner.numel() * inner.element_size()
        else:
            layout["dense"] += shard.numel() * shard.element_size()
    return layout


def nf4_gathered_bytes(numel: int, spec: NF4Spec, itemsize: int, shards: int) -> int:
    """Bytes FSDP2 all-gathers for an NF4 weight of `numel` elements sharded `shards` ways: the
    inner tensors of every shard (never padded; the per-tensor metadata stays on each rank)."""
    return shards * sum(v for k, v in nf4_bytes(numel, spec, itemsize, shards).items() if k in INNER)


# ---------------------------------------------------------------------------------------------
# Checks before launch
# ---------------------------------------------------------------------------------------------


def projection_shapes(model_config: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each decoder projection (every family's; torch's Linear convention). A mixture
    of experts' MLP projections are one expert's (`moe_intermediate_size` wide), stacked per layer."""
    c = model_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    inter = c.moe_intermediate_size if getattr(c, "num_experts", 0) else c.intermediate_size
    return {
        "q_proj": (q, c.hidden_size),
        "k_proj": (kv, c.hidden_size),
        "v_proj": (kv, c.hidden_size),
        "o_proj": (c.hidden_size, q),
        "gate_proj": (inter, c.hidden_size),
        "up_proj": (inter, c.hidden_size),
        "down_proj": (c.hidden_size, inter),
    }


def check_quantizable(spec: NF4Spec, model_config: PretrainedConfig, shards: int = 1) -> None:
    """ConfigError unless every projection splits into whole NF4 blocks and, across `shards`
    FSDP ranks, into whole rows and whole scale groups per rank."""
    shapes = projection_shapes(model_config)
    for name, (rows, cols) in shapes.items():
        if (rows * cols) % spec.block_size:
            raise ConfigError(
                f"--method qlora: {name} ({rows} x {cols} = {rows * cols} weights) does not split into NF4 "
                f"blocks of model.quant_block_size={spec.block_size}; pick a block size that divides it."
            )
    blocks = {name: rows * cols // spec.block_size for name, (rows, cols) in shapes.items()}
    for name, (rows, cols) in shapes.items():
        groups = blocks[name] // spec.group_size(rows * cols)
        if rows % shards == 0 and groups % shards == 0:
            continue
        fix = _shardable_fix(spec, shapes, shards)
        raise ConfigError(
            f"--method qlora with FSDP over {shards} ranks: {name} ({rows} x {cols}) holds {blocks[name]} NF4 "
            f"blocks in {groups} double-quantization group(s) of {spec.group_size(rows * cols)}, and each rank "
            f"must hold whole rows and whole groups (an NF4 weight cannot be padded or cut inside a group): {fix}."
        )


def _shardable_fix(spec: NF4Spec, shapes: dict[str, tuple[int, int]], shards: int) -> str:
    """The override that lets every projection split across `shards` FSDP ranks, if one does."""
    if any(rows % shards for rows, _ in shapes.values()):
        return "use a number of ranks that divides every projection's rows"
    for size in (256, 128, 64, 32, 16, 8, 4, 2, 1):
        candidate = dataclasses.replace(spec, scaler_block_size=size)
        if all(
            (rows * cols // spec.block_size // candidate.group_size(rows * cols)) % shards == 0
            for rows, cols in shapes.values()
        ):
            return f"set model.quant_scaler_block_size={size} (or lower)"
    return "use fewer ranks"
