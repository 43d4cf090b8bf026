"""The optimizer's hyperparameters in a checkpoint: one entry for the run, not one per parameter.

The optimizer state a strategy saves is flattened by parameter name (`state_dict_options`:
`state.<name>.exp_avg`, and `param_groups.<name>.lr`, `.betas`, `.eps`, ... for every trained
parameter), so that ranks holding different parameters (pipeline stages) each load their own. DCP
writes every non-tensor value as its own pickle, planned, gathered and read back one by one: a
micro LoRA run's 56 adapters gave 672 such entries beside 224 tensors, most of a checkpoint's time.
Here the `param_groups.*` entries become one JSON text under `param_groups`, every rank's names in
it (gathered before the save, so the copy DCP keeps is the same whoever writes it), and are spread
back by name on load. A checkpoint written before keeps its per-parameter entries and loads as it was.
"""

from __future__ import annotations

import json
from typing import Any

import torch.distributed as dist

PACKED = "param_groups"  # the optimizer state's key of the JSON text
PREFIX = "param_groups."  # the flattened per-parameter keys: param_groups.<name>.<hyperparameter>


def _split(key: str) -> tuple[str, str]:
    """(parameter name, hyperparameter) of a `param_groups.<name>.<hyperparameter>` key."""
    name, _, field = key[len(PREFIX) :].rpartition(".")
    return name, field


def packed(optim: dict[str, Any]) -> dict[str, Any]:
    """`optim` with its per-parameter `param_groups.*` entries replaced by one JSON text of every
    rank's (a collective where a process group runs); `optim` itself when a value is no JSON."""
    groups: dict[str, dict[str, Any]] = {}
    for key, value in optim.items():
        if key.startswith(PREFIX):
            name, field = _split(key)
            groups.setdefault(name, {})[field] = value
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, groups)
        groups = {name: fields for rank_groups in every for name, fields in rank_groups.items()}
    try:
        text = json.dumps(groups, sort_keys=True)
    except (TypeError, ValueError):  # a hyperparameter JSON cannot hold (a tensor): per-parameter entries
        return optim
    return {**{k: v for k, v in optim.items() if not k.startswith(PREFIX)}, PACKED: text}


def to_load(optim: dict[str, Any]) -> dict[str, Any]:
    """What DCP loads in place of `optim` (a strategy's flattened state) from a packed checkpoint."""
    return {**{k: v for k, v in optim.items() if not k.startswith(PREFIX)}, PACKED: ""}


def unpacked(loaded: dict[str, Any], optim: dict[str, Any]) -> dict[str, Any]:
    """`loaded` (`to_load`'s, filled by DCP) with the `param_groups.*` entries `optim` holds, read
    from the JSON text; a tuple stays a tuple (JSON has lists only)."""
    groups = json.loads(loaded[PACKED])
    spread = {k: v for k, v in loaded.items() if k != PACKED}
    for key, current in optim.items():
        if key.startswith(PREFIX):
            name, field = _split(key)
            value = groups[name][field]  # a parameter the checkpoint lacks: KeyError, a refusal
            spread[key] = tuple(value) if isinstance(current, tuple) else value
    return spread
