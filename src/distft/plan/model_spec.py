"""The architecture the planner counts: every weight tensor of a dense decoder-only LM, by shape.

The memory model needs shapes, not weights: FSDP2 pads dim 0 of each tensor separately, tensor
parallelism splits some tensors on dim 0 and others on dim 1, and QLoRA quantizes only the
projections. So the model is described as the list of its tensors (`TensorSpec`), each tagged
with what it is and how tensor parallelism splits it. A `Linear` weight is (out, in) in torch's
convention; column-parallel projections split `out` (dim 0), row-parallel ones split `in` (dim 1).

Where an architecture comes from (`resolve_model`, in this order):
1. a distft preset (`distft.model.PRESETS`: micro, tiny, qwen3-0.6b ... qwen3-32b);
2. the built-in table below, offline: hub ids of Qwen3 (mapped to the presets) and the Llama sizes
   the blog series' examples use (Llama-2-13B, Llama-3-8B, Llama-3-70B), plus short aliases;
3. a local directory holding config.json (or the config.json path itself);
4. the hub, only when online (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE unset): config.json alone is
   fetched; any failure becomes a one-paragraph `ConfigError`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from distft.errors import ConfigError
from distft.model import PRESETS, QWEN3_VOCAB
from distft.model.nf4 import projection_shapes
from distft.parallel import tensor_parallel

# Projections of one decoder layer by how TP splits them: the runtime's plan
# (`distft.parallel.tensor_parallel.COLUMN` / `ROW`, module paths), by projection name.
COLUMN = tuple(path.rsplit(".", 1)[-1] for path in tensor_parallel.COLUMN)
ROW = tuple(path.rsplit(".", 1)[-1] for path in tensor_parallel.ROW)
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: str  # "embed", "lm_head", "norm", "qk_norm", "linear" (a projection), "lora_A", "lora_B", "lora_magnitude"
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
    """A dense decoder-only transformer (Qwen3 or Llama), as far as memory is concerned."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qk_norm: bool = True  # Qwen3 RMS-normalises q and k per head; Llama does not
    family: str = "qwen3"
    source: str = "preset"  # where the architecture was read from

    @property
    def num_attention_heads(self) -> int:  # transformers' name, for `distft.model.nf4.projection_shapes`
        return self.num_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.num_kv_heads

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each projection of a decoder layer: the runtime's `projection_shapes`."""
        return projection_shapes(self)

    def layer_tensors(self, layer: int) -> list[TensorSpec]:
        """One decoder layer, in the order transformers registers its parameters."""
        out = []
        for name, shape in self.projection_shapes().items():
            out.append(
                TensorSpec(f"layers.{layer}.{name}", shape, "linear", 0 if name in COLUMN else 1, layer, name)
            )
        if self.qk_norm:
            out += [
                TensorSpec(f"layers.{layer}.q_norm", (self.head_dim,), "qk_norm", None, layer),
                TensorSpec(f"layers.{layer}.k_norm", (self.head_dim,), "qk_norm", None, layer),
            ]
        out += [
            TensorSpec(f"layers.{layer}.input_layernorm", (self.hidden_size,), "norm", None, layer),
            TensorSpec(f"layers.{layer}.post_attention_layernorm", (self.hidden_size,), "norm", None, layer),
        ]
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
        return (
            f"{self.name}: {self.num_params() / 1e9:.2f}B parameters, {self.num_layers} layers, hidden "
            f"{self.hidden_size}, MLP {self.intermediate_size}, {self.num_heads} query / {self.num_kv_heads} KV "
            f"heads of {self.head_dim}, vocab {self.vocab_size:,} ({tied} embeddings)"
        )


# ---------------------------------------------------------------------------------------------
# Where architectures come from
# ---------------------------------------------------------------------------------------------


def _from_preset(name: str, source: str = "preset") -> ModelSpec:
    p = PRESETS[name]
    return ModelSpec(
        name=name,
        vocab_size=QWEN3_VOCAB,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_layers=p.num_hidden_layers,
        num_heads=p.num_attention_heads,
        num_kv_heads=p.num_key_value_heads,
        head_dim=p.head_dim,
        tie_word_embeddings=p.tie_word_embeddings,
        source=source,
    )


def _llama(name: str, vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int) -> ModelSpec:
    return ModelSpec(
        name,
        vocab,
        hidden,
        inter,
        layers,
        heads,
        kv,
        hidden // heads,
        False,
        False,
        "llama",
        "built-in table",
    )


# Released configs (config.json on the hub), copied so the planner works offline.
LLAMA = {
    "meta-llama/llama-2-13b-hf": _llama("meta-llama/Llama-2-13b-hf", 32_000, 5120, 13_824, 40, 40, 40),
    "meta-llama/llama-2-7b-hf": _llama("meta-llama/Llama-2-7b-hf", 32_000, 4096, 11_008, 32, 32, 32),
    "meta-llama/llama-2-70b-hf": _llama("meta-llama/Llama-2-70b-hf", 32_000, 8192, 28_672, 80, 64, 8),
    "meta-llama/meta-llama-3-8b": _llama("meta-llama/Meta-Llama-3-8B", 128_256, 4096, 14_336, 32, 32, 8),
    "meta-llama/meta-llama-3-70b": _llama("meta-llama/Meta-Llama-3-70B", 128_256, 8192, 28_672, 80, 64, 8),
}
ALIASES = {
    "llama-2-7b": "meta-llama/llama-2-7b-hf",
    "llama-2-13b": "meta-llama/llama-2-13b-hf",
    "llama-2-70b": "meta-llama/llama-2-70b-hf",
    "llama-3-8b": "meta-llama/meta-llama-3-8b",
    "llama-3-70b": "meta-llama/meta-llama-3-70b",
    "meta-llama/llama-3.1-8b": "meta-llama/meta-llama-3-8b",  # same shapes as Llama 3
    "meta-llama/llama-3.1-70b": "meta-llama/meta-llama-3-70b",
    "meta-llama/meta-llama-3-8b-instruct": "meta-llama/meta-llama-3-8b",
    "meta-llama/meta-llama-3-70b-instruct": "meta-llama/meta-llama-3-70b",
}


def builtin_table() -> dict[str, ModelSpec]:
    """Lower-cased hub id or alias -> architecture, for every model the planner knows offline."""
    table = {
        p.hub_id.lower(): replace(_from_preset(key, "built-in table"), name=p.hub_id)
        for key, p in PRESETS.items()
        if p.hub_id
    }
    table.update(LLAMA)
    table.update({alias: LLAMA[target] for alias, target in ALIASES.items()})
    return table


def spec_from_config(cfg: dict, name: str, source: str) -> ModelSpec:
    """A `ModelSpec` from the fields of a transformers config.json."""
    model_type = cfg.get("model_type", "")
    if "moe" in model_type or cfg.get("num_experts") or cfg.get("num_local_experts"):
        raise ConfigError(
            f"{name} is a mixture-of-experts model ({model_type}); the planner models dense decoder-only "
            "transformers (Qwen3, Llama) only."
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
            qk_norm=model_type.startswith("qwen3"),
            family=model_type or "unknown",
            source=source,
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
        return _from_preset(name)
    table = builtin_table()
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
    known = ", ".join(sorted([*PRESETS, *ALIASES][:20]))
    if "/" not in name or _offline():
        why = "the hub is not consulted while offline" if "/" in name else "it is not a hub id (owner/name)"
        raise ConfigError(
            f"Unknown model {name!r}: it is not a preset, not in the built-in table, not a directory with a "
            f"config.json, and {why}. Known offline: {known}, and the hub ids of the Qwen3 presets "
            "(e.g. Qwen/Qwen3-4B); or point --model at a config.json."
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
