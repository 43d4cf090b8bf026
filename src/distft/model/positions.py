"""How far a model's rotary position embeddings reach, and stretching them further (RoPE scaling).

A rotary model is trained on positions 0 .. P-1 (`max_position_embeddings`); past P it has never
seen the angles its rotations reach, and its attention degrades. RoPE scaling rescales the
rotation frequencies so that a longer context maps onto angles the model knows:

- `linear` (position interpolation) divides every position by the factor;
- `dynamic` (NTK-aware) raises the rotary base, more the longer the sequence;
- `yarn` interpolates the low frequencies, keeps the high ones (the local word order) and
  rescales attention's temperature: what Qwen3 documents for contexts past 32,768 tokens
  (`"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}`
  reaches 131,072).

The factor multiplies the positions the model was pretrained on: `original x factor` positions
after scaling. A Qwen3 config declares 40,960 positions, 32,768 of context plus 8,192 for the
answer, and its model card scales from 32,768 (`Family.pretrained_context`); every other model
scales from what it declares.
Llama 3.1 and 3.2 already ship a scaling (`llama3`, 131,072 positions): distft does not stack a
second on top.

`scale_rope` writes the scaling into the transformers config before the model is built, so the
rotary module computes its frequencies from it and the config saved with the run records it;
`check_positions` refuses, before launch, a `data.max_length` past the model's positions and
names the setting that fixes it. The planner asks the same two questions (`distft.plan`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from distft.config.choices import ROPE_SCALINGS
from distft.errors import ConfigError
from distft.model.families import FAMILIES


def _field(config: Any, name: str) -> Any:
    """A config field from a transformers config or its dict (`to_dict()`, config.json)."""
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def rope_parameters(config: Any) -> dict:
    """The rotary settings: transformers 5 reads `rope_parameters`, older config.json files
    `rope_scaling` (with `type` for `rope_type`)."""
    params = dict(_field(config, "rope_parameters") or _field(config, "rope_scaling") or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    return params


def is_scaled(config: Any) -> bool:
    return rope_parameters(config).get("rope_type", "default") != "default"


def max_positions(config: Any) -> int:
    """The longest sequence the model's rotary embeddings cover, scaling included."""
    declared = int(_field(config, "max_position_embeddings") or 0)
    params = rope_parameters(config)
    if not is_scaled(config) or not params.get("factor"):
        return declared
    original = int(params.get("original_max_position_embeddings") or declared)
    return max(declared, int(original * float(params["factor"])))


def pretrained_positions(config: Any) -> int:
    """The positions a scaling multiplies: the context the model was pretrained on."""
    if original := rope_parameters(config).get("original_max_position_embeddings"):
        return int(original)
    declared = int(_field(config, "max_position_embeddings") or 0)
    family = FAMILIES.get(_field(config, "model_type") or "")
    return family.pretrained_context.get(declared, declared) if family else declared


def factor_for(config: Any, length: int) -> float:
    """The smallest power of two that stretches the pretrained context past `length`."""
    return float(2 ** max(1, math.ceil(math.log2(length / pretrained_positions(config)))))


def scaled_rope(config: Any, scaling: str, factor: float) -> dict:
    """The `rope_parameters` of `config` stretched by `factor` with `scaling`."""
    original = pretrained_positions(config)
    return {
        **rope_parameters(config),
        "rope_type": scaling,
        "factor": float(factor),
        "original_max_position_embeddings": original,
    }


def scale_rope(config: Any, scaling: str, factor: float, model: str = "the model") -> Any:
    """`config` (a transformers config or its dict, changed in place) with its rotary embeddings
    stretched; unchanged for `scaling="none"`."""
    if scaling == "none":
        return config
    current = rope_parameters(config)
    if current.get("rope_type") == scaling and current.get("factor") == factor:
        return config  # a config saved by an earlier run: scaled already, the same way
    if is_scaled(config):
        kind = current["rope_type"]
        raise ConfigError(
            f"{model} already scales its rotary embeddings ({kind}, {max_positions(config):,} positions); "
            f"distft does not stack a second scaling on it. Drop model.rope_scaling={scaling}."
        )
    params = scaled_rope(config, scaling, factor)
    # What the rotary module and later readers see as the model's reach.
    fields = {
        "rope_parameters": params,
        "max_position_embeddings": int(params["original_max_position_embeddings"] * params["factor"]),
    }
    for name, value in fields.items():
        if isinstance(config, dict):  # the planner's config.json fields
            config[name] = value
        else:
            setattr(config, name, value)
    return config


# How the fix is spelled: a run's settings, or the planner's flags.
RUN_SETTINGS = {
    "length": "data.max_length={n}",
    "scaling": "model.rope_scaling={kind} model.rope_factor={factor:g}",
    "factor": "model.rope_factor={factor:g}",
}


def check_positions(config: Any, model: str, length: int, spelled: Mapping[str, str] = RUN_SETTINGS) -> None:
    """Refuse sequences longer than the model's positions, naming the scaling that reaches them."""
    reach = max_positions(config)
    if not reach or length <= reach:
        return
    this, shorter = spelled["length"].format(n=length), spelled["length"].format(n=reach)
    factor = factor_for(config, length)
    if is_scaled(config):
        kind = rope_parameters(config)["rope_type"]
        fix = (
            f"{spelled['factor'].format(factor=factor)} (or a shorter sequence)"
            if kind in ROPE_SCALINGS
            else f"{shorter} or less"
        )
        raise ConfigError(
            f"{this} is longer than the {reach:,} positions {model}'s rotary embeddings reach with its "
            f"{kind} scaling. Set {fix}."
        )
    raise ConfigError(
        f"{this} is longer than the {reach:,} positions {model} was trained on: past them its rotary "
        f"embeddings reach angles it has never seen. Stretch them with "
        f"{spelled['scaling'].format(kind='yarn', factor=factor)} "
        f"({int(pretrained_positions(config) * factor):,} positions), or set {shorter} (or less)."
    )
