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

from distft.config import Config, lora_target_names
from distft.errors import ConfigError
from distft.io.checkpoint import latest_checkpoint
from distft.io.save import base_weights_written
from distft.model import DTYPES

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def output_bytes(cfg: Config, model_config: PretrainedConfig) -> dict[str, int]:
    """Estimated bytes each kind of output takes at its largest, from the architecture alone.

    The model is built on the meta device (no memory, no weights) to count parameters. A
    checkpoint holds the trainable weights and AdamW's two moments, all in the model dtype;
    keep_last + 1 exist while a new one is written (one, the last step's, without checkpoint_every); the exported adapter (or model) exists twice
    while it is replaced; a preset's base is saved once.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(model_config)
    itemsize = DTYPES[cfg.model.dtype].itemsize
    total = sum(p.numel() for p in lm.parameters())
    if cfg.train.method == "full":
        trainable = total
    else:  # LoRA: r x (in + out) per targeted Linear (a preset: the projections it names)
        targets = set(lora_target_names(cfg.lora.target_modules))
        trainable = sum(
            cfg.lora.rank * (m.in_features + m.out_features)
            for name, m in lm.named_modules()
            if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets
        )
    sizes = {"export": 2 * trainable * itemsize}
    # The last step is checkpointed before its validation and export, with checkpoint_every=0 too.
    kept = cfg.output.keep_last + 1 if cfg.output.checkpoint_every else 1
    sizes["checkpoints"] = kept * 3 * trainable * itemsize
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
        if cfg.train.max_steps <= step:  # nothing to train: it would only re-export, and cut metrics
            raise ConfigError(
                f"--resume {out}: that run finished at step {step}, and train.max_steps={cfg.train.max_steps} "
                f"would train nothing more but rewrite its {_exported(out)} and cut its metrics. Give "
                f"--max-steps above {step} to continue it, or --overwrite to train it again from the start."
            )
        return
    if resuming:
        raise ConfigError(
            f"--resume {out}: that run finished at step {step} and kept no checkpoint to continue from "
            "(checkpoints are written with --checkpoint-every N). Use --overwrite to train it again from "
            "the start, or another --out."
        )
    what = f"{out} holds a finished run (step {step}, its {_exported(out)} exported); this command would replace it."
    if checkpoint is None:
        raise ConfigError(
            f"{what} Choose another --out for a new run, or --overwrite to replace it (--resume continues "
            "a run from a checkpoint, and this one has none)."
        )
    raise ConfigError(
        f"{what} Choose another --out for a new run, `distft train --resume {out} --max-steps N` to "
        f"continue it from its checkpoint {checkpoint.name}, or --overwrite to replace it."
    )


def _exported(run_dir: Path) -> str:
    return "model" if (run_dir / "model").is_dir() else "adapter"


# What a run writes in its directory; nothing but the run itself (or --overwrite) may replace them.
RUN_FILES = ("config.toml", "metrics.jsonl", "ranks.json", "lineage.json", "manifest.json", ".lock")
RUN_DIRS = ("adapter", "model", "base", "checkpoints", "events")


def run_part(path: Path) -> tuple[Path, str] | None:
    """(run directory, what of it) when writing `path` would replace something a run wrote: the run
    directory itself, one of its files, or anything inside its adapter/, model/, base/ or
    checkpoints/. A new file beside them (an eval report in the run directory) is not."""
    path = Path(path).resolve()
    for candidate in (path, *path.parents):
        if not (candidate / "config.toml").is_file() or not (candidate / "metrics.jsonl").is_file():
            continue
        parts = path.relative_to(candidate).parts
        if not parts:
            return candidate, "the run directory itself"
        if parts[0] in RUN_DIRS or (len(parts) == 1 and parts[0] in RUN_FILES):
            return candidate, f"its {parts[0]}"
        return None
    return None


def check_output_path(path: Path, flag: str, directory: bool = False) -> None:
    """Before any work: `path` (a file, or with `directory` a directory, to be written) replaces
    nothing a run wrote, is of the right kind, and can be written."""
    path = Path(path)
    if (owner := run_part(path)) is not None:
        run_dir, part = owner
        raise ConfigError(
            f"{flag} {path} would write over {part} of the run {run_dir}; nothing a run wrote is replaced. "
            "Choose a path outside it."
        )
    if not directory and path.is_dir():
        raise ConfigError(f"{flag} {path} is a directory; give a file name.")
    if directory and path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path} is a file; give a directory.")
    check_writable(path if directory else path.resolve().parent, flag)


def check_output_dir(cfg: Config, model_config: PretrainedConfig) -> None:
    """Refuse, before anything is launched, an output directory that cannot be written or lacks
    the space for the run's outputs (`output_bytes`)."""
    out = Path(cfg.output.dir)
    check_writable(out)
    existing = out.absolute()  # created by the run, not here (`distft train --dry-run` writes nothing)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    sizes = output_bytes(cfg, model_config)
    free = shutil.disk_usage(existing).free
    if sum(sizes.values()) > free:
        parts = ", ".join(f"{name} {_gb(n)}" for name, n in sizes.items())
        raise ConfigError(
            f"Output directory {out} has {_gb(free)} free, but the run needs about "
            f"{_gb(sum(sizes.values()))} ({parts}). Free some space, point --out at another disk, or "
            "lower output.keep_last."
        )


def check_writable(out: Path, flag: str = "--out") -> None:
    """Write a probe file in `out`, or in its nearest existing parent when it does not exist yet
    (nothing is created), or refuse naming the reason (a read-only disk, a file in the way, no
    permission): found before any work, whoever runs it, root included."""
    existing = Path(out).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".distft-write-test-"):
            pass
    except OSError as err:
        raise ConfigError(
            f"Output directory {out} is not writable ({err.strerror or err}). Point {flag} at a directory "
            "you can write to."
        ) from None


def _gb(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= 10 * size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"
