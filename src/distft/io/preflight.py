"""Before launch: may the run write its outputs, and can it? (no finished run replaced by accident,
writable, room on the disk)"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from distft.config import Config
from distft.errors import ConfigError
from distft.io.checkpoint import latest_checkpoint
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


def finished_step(run_dir: Path) -> int | None:
    """The last step of the finished run in `run_dir` (one that exported its adapter or model), or None."""
    run_dir = Path(run_dir)
    exported = (run_dir / "adapter" / "adapter_config.json").is_file() or (
        run_dir / "model" / "config.json"
    ).is_file()
    if not exported:
        return None
    step = 0
    metrics = run_dir / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.is_file() else []:
        try:
            step = max(step, int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short
    return step


def check_finished_run(cfg: Config, resuming: bool = False) -> None:
    """Refuse to replace a finished run silently: it takes --overwrite, or --resume to continue it.

    A run that stopped early with checkpoints is not finished: it resumes, as before. `resuming`:
    the user asked for `--resume DIR`, which continues from the run's latest checkpoint.
    """
    out = Path(cfg.output.dir)
    step = finished_step(out)
    if step is None or cfg.output.overwrite:
        return
    checkpoint = latest_checkpoint(out)
    if resuming and checkpoint is not None:
        return
    if resuming:
        raise ConfigError(
            f"--resume {out}: that run finished at step {step} and kept no checkpoint to continue from "
            "(checkpoints are written with --checkpoint-every N). Use --overwrite to train it again from "
            "the start, or another --out."
        )
    exported = "model" if (out / "model").is_dir() else "adapter"
    what = (
        f"{out} holds a finished run (step {step}, its {exported} exported); this command would replace it."
    )
    if checkpoint is None:
        raise ConfigError(
            f"{what} Choose another --out for a new run, or --overwrite to replace it (--resume continues "
            "a run from a checkpoint, and this one has none)."
        )
    raise ConfigError(
        f"{what} Choose another --out for a new run, `distft train --resume {out} --max-steps N` to "
        f"continue it from its checkpoint {checkpoint.name}, or --overwrite to replace it."
    )


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
