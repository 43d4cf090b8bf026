"""The architecture the planner counts: every weight tensor of a dense decoder-only LM, by shape.

The memory model needs shapes, not weights: FSDP2 pads dim 0 of each tensor separately, tensor
parallelism splits some tensors on dim 0 and others on dim 1, and QLoRA quantizes only the
projections' weights. So the model is described as the list of its tensors (`TensorSpec`), each
tagged with what it is and how tensor parallelism splits it. A `Linear` weight is (out, in) in
torch's convention; column-parallel projections split `out` (dim 0), row-parallel ones split `in`
(dim 1). A bias (Qwen2's q/k/v) is (out,) and follows its weight's rows.

Sizes come from a transformers config (a preset's `Preset.to_config()`, a config.json), and what a
layer holds beyond its projections (q/k norms, biases) from the model family
(`distft.model.families`): no size is written here. A config of a type distft has no family for
is still planned as a plain dense layer (no q/k norm, no biases), named by its `model_type`.

Where an architecture comes from (`resolve_model`, in this order):
1. a distft preset (`distft.model.PRESETS`: micro, tiny, llama-micro ..., qwen3-4b, llama3-8b, ...);
2. offline, a hub id: each preset's `hub_id` and its `aliases` (instruct variants, short names),
   the Llama sizes the blog series' examples use (Llama-2 7B/13B/70B, Llama-3 70B) included;
3. a local directory holding config.json (or the config.json path itself);
4. the hub, only when online (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE unset): config.json alone is
   fetched; any failure becomes a one-paragraph `ConfigError`.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from distft.config import PROJECTION_NAMES
from distft.errors import ConfigError
from distft.model import PRESETS
from distft.model.families import FAMILIES
from distft.model.nf4 import projection_shapes
from distft.parallel import tensor_parallel

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
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ModelSpec:
    """A dense decoder-only transformer of one family, as far as memory is concerned."""

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
            column = name in COLUMN
            out.append(TensorSpec(f"layers.{layer}.{name}", shape, "linear", 0 if column else 1, layer, name))
            if name in self.biased:  # split with its weight's rows (a row projection's would be whole)
                bias = f"layers.{layer}.{name}.bias"
                out.append(TensorSpec(bias, shape[:1], "bias", 0 if column else None, layer, name))
            if name == "o_proj" and self.qk_norm:  # the last module of self_attn
                for norm in ("q_norm", "k_norm"):
                    out.append(TensorSpec(f"layers.{layer}.{norm}", (self.head_dim,), "qk_norm", None, layer))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out.append(TensorSpec(f"layers.{layer}.{norm}", (self.hidden_size,), "norm", None, layer))
        return out

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
        (peft's `lora_magnitude_vector`; no TP strategy runs it)."""
        out = []
        shapes = self.projection_shapes()
        for layer in range(self.num_layers):
            for name, (o, i) in shapes.items():
                if name not in targets:
                    continue
                column = name in COLUMN
                out.append(
                    TensorSpec(
                        f"layers.{layer}.{name}.lora_A",
                        (rank, i),
                        "lora_A",
                        None if column else 1,
                        layer,
                        name,
                    )
                )
                out.append(
                    TensorSpec(
                        f"layers.{layer}.{name}.lora_B",
                        (o, rank),
                        "lora_B",
                        0 if column else None,
                        layer,
                        name,
                    )
                )
                if dora:
                    magnitude = f"layers.{layer}.{name}.lora_magnitude"
                    out.append(
                        TensorSpec(magnitude, (o,), "lora_magnitude", 0 if column else None, layer, name)
                    )
        return out

    def num_params(self) -> int:
        return sum(t.numel for t in self.tensors())

    def describe(self) -> str:
        tied = "tied" if self.tie_word_embeddings else "untied"
        extras = (["q/k norm"] if self.qk_norm else []) + (
            [f"{'/'.join(self.biased)} bias"] if self.biased else []
        )
        return (
            f"{self.name}: {self.num_params() / 1e9:.2f}B parameters, {self.family} family, {self.num_layers} "
            f"layers, hidden {self.hidden_size}, MLP {self.intermediate_size}, {self.num_heads} query / "
            f"{self.num_kv_heads} KV heads of {self.head_dim}{''.join(f', {e}' for e in extras)}, vocab "
            f"{self.vocab_size:,} ({tied} embeddings)"
        )


# ---------------------------------------------------------------------------------------------
# Where architectures come from
# ---------------------------------------------------------------------------------------------


def preset_spec(key: str, name: str | None = None, source: str = "preset") -> ModelSpec:
    """A preset's architecture, read from the config it builds (`Preset.to_config`)."""
    return spec_from_config(PRESETS[key].to_config().to_dict(), name or key, source)


@functools.cache  # specs are frozen: built once per process
def _table() -> dict[str, ModelSpec]:
    """Lower-cased hub id or alias -> architecture (`builtin_table`'s, shared): every released
    preset under its hub id and its aliases, named by the alias if it is a hub id, else by the hub id."""
    table = {}
    for key, p in PRESETS.items():
        if not p.hub_id:
            continue
        spec = preset_spec(key, p.hub_id, "built-in table")
        table[p.hub_id.lower()] = spec
        for alias in p.aliases:
            table[alias.lower()] = replace(spec, name=alias) if "/" in alias else spec
    return table


def builtin_table() -> dict[str, ModelSpec]:
    """Lower-cased hub id or alias -> architecture, for every model the planner knows offline."""
    return dict(_table())


ROTARY_FIELDS = ("model_type", "max_position_embeddings", "rope_parameters", "rope_scaling")


def spec_from_config(cfg: dict, name: str, source: str) -> ModelSpec:
    """A `ModelSpec` from the fields of a transformers config (`config.json`, `to_dict()`)."""
    model_type = cfg.get("model_type", "")
    if "moe" in model_type or cfg.get("num_experts") or cfg.get("num_local_experts"):
        dense = ", ".join(n for n, f in FAMILIES.items() if not f.moe)
        raise ConfigError(
            f"{name} is a mixture-of-experts model ({model_type}), whose experts the planner does not count "
            f"yet; it models dense decoder-only transformers (the families {dense})."
        )
    family = FAMILIES.get(model_type)  # None: a dense layer with neither q/k norms nor biases
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
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(
            f"{name}'s config has no usable {err} field; the planner needs vocab_size, hidden_size, "
            "intermediate_size, num_hidden_layers and num_attention_heads."
        ) from None


def _offline() -> bool:
    return any(
        os.environ.get(v, "").lower() in ("1", "true", "yes")
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def resolve_model(name: str) -> ModelSpec:
    """The architecture named by `name` (preset, hub id, alias, directory or config.json)."""
    if name in PRESETS:
        return preset_spec(name)
    table = _table()
    if name.lower() in table:
        return table[name.lower()]
    path = Path(name)
    if path.is_file() and path.name.endswith(".json"):
        return spec_from_config(json.loads(path.read_text()), name, "config.json")
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ConfigError(f"Model directory {name} has no config.json.")
        return spec_from_config(json.loads(config.read_text()), name, "config.json")
    if "/" not in name or _offline():
        why = "the hub is not consulted while offline" if "/" in name else "it is not a hub id (owner/name)"
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
