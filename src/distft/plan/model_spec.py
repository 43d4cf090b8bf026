"""The architecture the planner counts: every weight tensor of a decoder-only LM, by shape.

The memory model needs shapes, not weights: FSDP2 pads dim 0 of each tensor separately, tensor
parallelism splits some tensors on dim 0 and others on dim 1, and QLoRA quantizes only the
projections' weights. So the model is the list of its tensors (`TensorSpec`), each tagged with
what it is and how TP splits it. A `Linear` weight is (out, in): column-parallel projections split
`out` (dim 0), row-parallel ones `in` (dim 1); a bias (Qwen2's q/k/v) follows its weight's rows.
A mixture of experts (Qwen3-MoE) holds each layer's experts in two stacks and a router
(`expert_tensors`): all of them count in memory, a token's top-k in FLOPs (`active_params`).

Sizes come from a transformers config (a preset's `Preset.to_config()`, a config.json), and what a
layer holds beyond its projections (q/k norms, biases, experts) from the model family
(`distft.model.families`): no size is written here. A config of a type distft has no family for
is still planned as a plain dense layer (no q/k norm, no biases), named by its `model_type`.

Where an architecture comes from (`resolve_model`, in this order):
1. a distft preset (`distft.model.PRESETS`: micro, tiny, llama-micro ..., qwen3-4b, llama3-8b, ...);
2. offline, a hub id: each preset's `hub_id` and its `aliases` (instruct variants, short names);
3. a local directory holding config.json (or the config.json path itself);
4. the hub, only when online (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE unset): config.json alone.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from distft.config import PROJECTION_NAMES
from distft.errors import ConfigError
from distft.hub import hub_offline
from distft.model import PRESETS
from distft.model.families import FAMILIES
from distft.model.nf4 import projection_shapes
from distft.parallel import tensor_parallel
from distft.parallel.pipeline.cost import MLP_PROJECTIONS

# Projections of one decoder layer by how TP splits them: the runtime's plan
# (`distft.parallel.tensor_parallel.COLUMN` / `ROW`, module paths), by projection name.
COLUMN = tuple(path.rsplit(".", 1)[-1] for path in tensor_parallel.COLUMN)
ROW = tuple(path.rsplit(".", 1)[-1] for path in tensor_parallel.ROW)
DEFAULT_LORA_TARGETS = PROJECTION_NAMES  # every projection, as lora.target_modules' default


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    # "embed", "lm_head", "norm", "qk_norm", "linear" (a projection's weight), "bias" (a projection's),
    # "lora_A", "lora_B", "lora_magnitude"
    kind: str
    tp_dim: int | None = None  # dim split by tensor parallelism (None: replicated on TP ranks)
    layer: int | None = None  # decoder layer index; None for embeddings, final norm, lm_head
    module: str = ""  # projection name for linear / LoRA tensors (q_proj, ...)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer of one family, as far as memory is concerned."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qk_norm: bool = True  # q_norm / k_norm per head (`Family.qk_norm`: Qwen3's)
    biased: tuple[str, ...] = ()  # projections with a bias (`Family.biased`: Qwen2's q, k, v)
    family: str = "qwen3"  # the family's name (`distft.model.families`), else the config's model_type
    source: str = "preset"  # where the architecture was read from
    # The config fields that say how far its rotary embeddings reach (`distft.model.positions`).
    rotary: dict = field(default_factory=dict, compare=False, hash=False)
    # A mixture of experts (Qwen3-MoE): each layer's MLP is `num_experts` experts of
    # `moe_intermediate_size`, of which each token takes `num_experts_per_tok`; 0: a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_attention_heads(self) -> int:  # transformers' name, for `distft.model.nf4.projection_shapes`
        return self.num_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.num_kv_heads

    @property
    def num_hidden_layers(self) -> int:  # transformers' name, for the stage cost model
        return self.num_layers

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each projection of a decoder layer: the runtime's `projection_shapes`."""
        return projection_shapes(self)

    def layer_tensors(self, layer: int) -> list[TensorSpec]:
        """One decoder layer, in the order transformers registers its parameters: attention (each
        projection's weight, then its bias; then q/k norms), the MLP, the two norms."""
        out = []
        for name, shape in self.projection_shapes().items():
            if self.moe and name in MLP_PROJECTIONS:
                continue  # the experts' stacks, below
            column = name in COLUMN
            out.append(TensorSpec(f"layers.{layer}.{name}", shape, "linear", 0 if column else 1, layer, name))
            if name in self.biased:  # split with its weight's rows (a row projection's would be whole)
                bias = f"layers.{layer}.{name}.bias"
                out.append(TensorSpec(bias, shape[:1], "bias", 0 if column else None, layer, name))
            if name == "o_proj" and self.qk_norm:  # the last module of self_attn
                for norm in ("q_norm", "k_norm"):
                    out.append(TensorSpec(f"layers.{layer}.{norm}", (self.head_dim,), "qk_norm", None, layer))
        if self.moe:
            out += self.expert_tensors(layer)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out.append(TensorSpec(f"layers.{layer}.{norm}", (self.hidden_size,), "norm", None, layer))
        return out

    def expert_tensors(self, layer: int) -> list[TensorSpec]:
        """An MoE layer's MLP as transformers holds it: every expert's gate and up fused in one
        stack (experts, 2 x moe_intermediate, hidden), the down projections in another (experts,
        hidden, moe_intermediate), and the router (experts, hidden). TP splits each expert along
        its intermediate dimension (gate_up's rows, down's columns); FSDP2 along the experts."""
        e, i, h, path = self.num_experts, self.moe_intermediate_size, self.hidden_size, f"layers.{layer}"
        return [
            TensorSpec(f"{path}.experts.gate_up_proj", (e, 2 * i, h), "experts", 1, layer, "gate_up_proj"),
            TensorSpec(f"{path}.experts.down_proj", (e, h, i), "experts", 2, layer, "down_proj"),
            TensorSpec(f"{path}.gate", (e, h), "router", None, layer, "gate"),
        ]

    def tensors(self) -> list[TensorSpec]:
        """Every weight of the model; a tied lm_head is the embedding itself and is listed once."""
        out = [TensorSpec("embed_tokens", (self.vocab_size, self.hidden_size), "embed")]
        for layer in range(self.num_layers):
            out += self.layer_tensors(layer)
        out.append(TensorSpec("norm", (self.hidden_size,), "norm"))
        if not self.tie_word_embeddings:
            out.append(TensorSpec("lm_head", (self.vocab_size, self.hidden_size), "lm_head"))
        return out

    def lora_tensors(
        self, rank: int, targets: tuple[str, ...] = DEFAULT_LORA_TARGETS, dora: bool = False
    ) -> list[TensorSpec]:
        """LoRA adapters, sharded with their base under TP (see `parallel/tensor_parallel.py`):
        a column base keeps lora_A (r, in) replicated and splits lora_B (out, r) on out; a row base
        splits lora_A on in and keeps lora_B replicated. DoRA adds a magnitude (out,) per projection
        (peft's `lora_magnitude_vector`; no TP strategy runs it). An MoE's experts take one adapter
        per stack (`expert_adapters`)."""
        out = []
        for layer in range(self.num_layers):
            for name, (o, i) in self.projection_shapes().items():
                if name not in targets or (self.moe and name in MLP_PROJECTIONS):
                    continue
                a_dim, b_dim = (None, 0) if name in COLUMN else (1, None)
                path = f"layers.{layer}.{name}"
                out.append(TensorSpec(f"{path}.lora_A", (rank, i), "lora_A", a_dim, layer, name))
                out.append(TensorSpec(f"{path}.lora_B", (o, rank), "lora_B", b_dim, layer, name))
                if dora:
                    out.append(
                        TensorSpec(f"{path}.lora_magnitude", (o,), "lora_magnitude", b_dim, layer, name)
                    )
            if self.moe:
                out += self.expert_adapters(layer, rank, targets)
        return out

    def expert_adapters(self, layer: int, rank: int, targets: tuple[str, ...]) -> list[TensorSpec]:
        """peft's adapters on an MoE layer's expert stacks (`target_parameters`): one rank-r pair per
        expert, stacked, lora_A (experts x r, in) and lora_B (out, experts x r). gate and up share
        the fused stack's one pair (both targeted, or neither); each factor splits under TP as its
        stack does: gate_up's lora_B on its rows, down's lora_A on its columns."""
        er, i, h = self.num_experts * rank, self.moe_intermediate_size, self.hidden_size
        stacks = {"gate_up_proj": ((2 * i, h), (None, 0)), "down_proj": ((h, i), (1, None))}
        out = []
        for stack, ((o, inp), (a_dim, b_dim)) in stacks.items():
            if not set(targets) & ({"gate_proj", "up_proj"} if stack == "gate_up_proj" else {"down_proj"}):
                continue
            path = f"layers.{layer}.experts.{stack}"
            out.append(TensorSpec(f"{path}.lora_A", (er, inp), "lora_A", a_dim, layer, stack))
            out.append(TensorSpec(f"{path}.lora_B", (o, er), "lora_B", b_dim, layer, stack))
        return out

    def num_params(self) -> int:
        return sum(t.numel for t in self.tensors())

    def active_params(self) -> int:
        """Parameters a token computes with: an MoE's top-k experts of each layer, not all of them."""
        return sum(
            t.numel // self.num_experts * self.num_experts_per_tok if t.kind == "experts" else t.numel
            for t in self.tensors()
        )

    def describe(self) -> str:
        tied = "tied" if self.tie_word_embeddings else "untied"
        extras = (["q/k norm"] if self.qk_norm else []) + (
            [f"{'/'.join(self.biased)} bias"] if self.biased else []
        )
        mlp = (
            f"{self.num_experts} experts of {self.moe_intermediate_size} ({self.num_experts_per_tok} per token: "
            f"{self.active_params() / 1e9:.2f}B parameters active)"
            if self.moe
            else f"MLP {self.intermediate_size}"
        )
        return (
            f"{self.name}: {self.num_params() / 1e9:.2f}B parameters, {self.family} family, {self.num_layers} "
            f"layers, hidden {self.hidden_size}, {mlp}, {self.num_heads} query / "
            f"{self.num_kv_heads} KV heads of {self.head_dim}{''.join(f', {e}' for e in extras)}, vocab "
            f"{self.vocab_size:,} ({tied} embeddings)"
        )


# ---- Where architectures come from --------------------------------------------------------------


def preset_spec(key: str, name: str | None = None, source: str = "preset") -> ModelSpec:
    """A preset's architecture, read from the config it builds (`Preset.to_config`)."""
    return spec_from_config(PRESETS[key].to_config().to_dict(), name or key, source)


@functools.cache  # specs are frozen: built once per process (the table is shared: not to be changed)
def builtin_table() -> dict[str, ModelSpec]:
    """Lower-cased hub id or alias -> architecture, for every model the planner knows offline: every
    released preset under its hub id and its aliases, named by the alias if it is a hub id, else by
    the hub id."""
    table = {}
    for key, p in PRESETS.items():
        if not p.hub_id:
            continue
        spec = preset_spec(key, p.hub_id, "built-in table")
        table[p.hub_id.lower()] = spec
        for alias in p.aliases:
            table[alias.lower()] = replace(spec, name=alias) if "/" in alias else spec
    return table


ROTARY_FIELDS = ("model_type", "max_position_embeddings", "rope_parameters", "rope_scaling")


def spec_from_config(cfg: dict, name: str, source: str) -> ModelSpec:
    """A `ModelSpec` from the fields of a transformers config (`config.json`, `to_dict()`)."""
    model_type = cfg.get("model_type", "")
    family = FAMILIES.get(model_type)  # None: a dense layer with neither q/k norms nor biases
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    sparse_every_layer = not cfg.get("mlp_only_layers") and int(cfg.get("decoder_sparse_step") or 1) == 1
    if experts and not (family and family.moe and sparse_every_layer):
        raise ConfigError(
            f"{name} is a mixture of experts ({model_type}) the planner cannot count: it knows Qwen3-MoE's "
            "experts with every layer an MoE layer (no mlp_only_layers, decoder_sparse_step 1), and dense models."
        )
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return ModelSpec(
            name=name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=family.qk_norm if family else False,
            biased=family.biased if family else (),
            family=model_type or "unknown",
            source=source,
            rotary={k: cfg.get(k) for k in ROTARY_FIELDS if cfg.get(k) is not None},
            num_experts=experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0) if experts else 0,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(
            f"{name}'s config has no usable {err} field; the planner needs vocab_size, hidden_size, "
            "intermediate_size, num_hidden_layers and num_attention_heads."
        ) from None


def resolve_model(name: str) -> ModelSpec:
    """The architecture named by `name` (preset, hub id, alias, directory or config.json)."""
    if name in PRESETS:
        return preset_spec(name)
    table = builtin_table()
    if name.lower() in table:
        return table[name.lower()]
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"Model directory {name} has no config.json.")
    if path.is_file() and path.name.endswith(".json"):
        return spec_from_config(json.loads(path.read_text()), name, "config.json")
    if "/" not in name or hub_offline():  # unreachable too: not five retries of ~6 s each
        why = "the hub is offline or out of reach" if "/" in name else "it is not a hub id (owner/name)"
        known = ", ".join([*PRESETS, *(a for p in PRESETS.values() for a in p.aliases if "/" not in a)])
        raise ConfigError(
            f"Unknown model {name!r}: it is not a preset, not in the built-in table, not a directory with a "
            f"config.json, and {why}. Known offline: {known}, and the presets' hub ids "
            "(e.g. Qwen/Qwen3-4B, meta-llama/Llama-3.1-8B); or point --model at a config.json."
        )
    return _fetch_config(name)


def _fetch_config(name: str) -> ModelSpec:
    """config.json from the hub (online only); every failure is a ConfigError."""
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(name, "config.json", etag_timeout=5)
        return spec_from_config(json.loads(Path(path).read_text()), name, "hub")
    except ConfigError:
        raise
    except Exception as err:  # network, auth, missing repo: all mean "cannot know the architecture"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"Unknown model {name!r}: not a preset or a built-in architecture, and its config.json could not "
            f"be fetched from the hub ({first}). Download it and pass --model path/to/config.json."
        ) from None
