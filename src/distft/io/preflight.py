"""Before launch: can the run write its outputs? (writable, and room for them on the disk)"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from distft.config import Config
from distft.errors import ConfigError
from distft.io.export import base_weights_written
from distft.model import DTYPES

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def output_bytes(cfg: Config, model_config: PretrainedConfig) -> dict[str, int]:
    """Estimated bytes each kind of output takes at its largest, from the architecture alone.

    The model is built on the meta device (no memory, no weights) to count parameters. A
    checkpoint holds the trainable weights and AdamW's two moments, all in the model dtype;
    keep_last + 1 exist while a new one is written; the exported adapter (or model) exists twice
    while it is replaced; a preset's base is saved once.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(model_config)
    itemsize = DTYPES[cfg.model.dtype].itemsize
    total = sum(p.numel() for p in lm.parameters())
    if cfg.train.method == "full":
        trainable = total
    else:  # LoRA: r x (in + out) per targeted Linear
        targets = set(cfg.lora.target_modules)
        trainable = sum(
            cfg.lora.rank * (m.in_features + m.out_features)
            for name, m in lm.named_modules()
            if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets
        )
    sizes = {"export": 2 * trainable * itemsize}
    if cfg.output.checkpoint_every:
        sizes["checkpoints"] = (cfg.output.keep_last + 1) * 3 * trainable * itemsize
    if base_weights_written(cfg):
        sizes["base"] = total * itemsize
    return sizes


def check_output_dir(cfg: Config, model_config: PretrainedConfig) -> None:
    """Refuse, before anything is launched, an output directory that cannot be written or lacks
    the space for the run's outputs (`output_bytes`)."""
    out = Path(cfg.output.dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".distft-write-test-"):
            pass
    except OSError as err:
        raise ConfigError(
            f"Output directory {out} is not writable ({err.strerror or err}). Point --out at a directory "
            "you can write to."
        ) from None
    sizes = output_bytes(cfg, model_config)
    free = shutil.disk_usage(out).free
    if sum(sizes.values()) > free:
        parts = ", ".join(f"{name} {_gb(n)}" for name, n in sizes.items())
        raise ConfigError(
            f"Output directory {out} has {_gb(free)} free, but the run needs about "
            f"{_gb(sum(sizes.values()))} ({parts}). Free some space, point --out at another disk, or "
            "lower output.keep_last."
        )


def _gb(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= 10 * size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"
