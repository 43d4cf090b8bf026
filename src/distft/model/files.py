"""What a model directory must be before anything loads it, checked before launch: a path that
names a directory (never taken for a hub id), weights as safetensors (pickles only when allowed)
whose headers place every tensor inside the file."""

from __future__ import annotations

import json
from pathlib import Path

from distft.config import ModelConfig
from distft.errors import ConfigError, DamagedFileError
from distft.hub import not_a_directory
from distft.model.presets import PRESETS


def check_model_path(name: str) -> None:
    """A `--model` that is a path names a directory, never a hub id (`distft.hub.not_a_directory`)."""
    if problem := not_a_directory(name):
        raise ConfigError(problem)


def check_weight_files(cfg: ModelConfig) -> None:
    """Refuse, before launch, a model directory whose weights are pickles only (`*.bin`, `*.pt`):
    unpickling runs whatever the file asks for, so it needs `model.allow_pickle_weights=true`. And
    a `model.revision` for a model that has none (a preset, a directory)."""
    folder = Path(cfg.name)
    if cfg.revision and (cfg.name in PRESETS or folder.is_dir()):
        kind = "a preset" if cfg.name in PRESETS else "a local directory"
        raise ConfigError(
            f"model.revision={cfg.revision!r} pins a commit of a hub model, but {cfg.name} is {kind}, which "
            "has no revisions. Leave model.revision empty, or give a hub id (e.g. Qwen/Qwen3-4B)."
        )
    if cfg.name in PRESETS or not folder.is_dir():
        return
    for weights in sorted(folder.glob("*.safetensors")):
        if problem := safetensors_damage(weights):
            raise DamagedFileError(
                f"Model directory {folder}: {weights.name} {problem}. It is damaged (a download or copy cut "
                "short): download or export it again."
            )
    if cfg.allow_pickle_weights or any(folder.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in [*folder.glob("*.bin"), *folder.glob("*.pt")])
    if pickles:
        raise ConfigError(
            f"Model directory {folder} holds its weights as pickles only ({', '.join(pickles)}), and loading a "
            "pickle runs whatever code it asks for. If you trust where it came from, set "
            "model.allow_pickle_weights=true; better, convert it once to safetensors (`model.save_pretrained(DIR)` "
            "in transformers writes them) and point --model at that."
        )


def safetensors_damage(path: Path) -> str | None:
    """What is wrong with a safetensors file, read from its header alone (no tensor is loaded): a
    header that does not parse, or tensors placed past the end of the file; None if it is whole."""
    try:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size)) if 0 < size < 100 << 20 else None
    except (OSError, ValueError):
        header = None
    if not isinstance(header, dict):
        return "has no readable safetensors header"
    ends = [e["data_offsets"][1] for k, e in header.items() if k != "__metadata__" and isinstance(e, dict)]
    have = path.stat().st_size - 8 - size
    return (
        f"holds {have:,} bytes of tensors, and its header places {max(ends):,}"
        if ends and max(ends) > have
        else None
    )
