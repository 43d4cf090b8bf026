"""Run outputs, written so that a crash never leaves a half-written file where a good one was.

Every directory is written under a temporary name beside its final place and renamed into place
once complete (a rename within one filesystem is atomic), so a reader sees the old version or the
new one, never a mix.

- `DIR/adapter/`: a standard PEFT adapter (adapter_config.json + adapter_model.safetensors) that
  `PeftModel.from_pretrained` loads in a plain Python process, whatever strategy trained it.
- `DIR/model/`: the whole model, for full finetuning (config.json + model.safetensors).
- `DIR/base/`: the randomly initialised base of a preset model, with the tokenizer, so an adapter
  trained on a preset can be loaded anywhere (presets have no weights on the hub).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from torch import nn

from distft.errors import CheckpointError, ConfigError
from distft.io.files import atomic_directory, atomic_write_text

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from distft.config import Config


def save_adapter(
    peft_model: nn.Module,
    state: dict[str, torch.Tensor],
    out: Path,
    base_ref: str,
    quantization: dict | None = None,
) -> None:
    """Write `state` (the trained LoRA weights, peft's full names) as a PEFT adapter in `out`.

    A QLoRA adapter also gets `quantization.json` (`distft.model.nf4`): it was trained against the
    NF4-quantized base, which `distft infer` rebuilds (dequantized) before loading it."""
    from peft import get_peft_model_state_dict

    adapter = get_peft_model_state_dict(peft_model, state_dict=state)
    config = peft_model.peft_config["default"]
    config.base_model_name_or_path = base_ref
    with atomic_directory(out) as tmp:
        config.save_pretrained(str(tmp))
        save_file(
            {k: v.contiguous() for k, v in adapter.items()},
            str(tmp / "adapter_model.safetensors"),
            metadata={"format": "pt"},
        )
        if quantization is not None:
            from distft.model.nf4 import QUANTIZATION_FILE

            (tmp / QUANTIZATION_FILE).write_text(json.dumps(quantization, indent=1) + "\n")


def save_full_model(lm: nn.Module, state: dict[str, torch.Tensor], out: Path) -> None:
    """Write a fully finetuned model in transformers' layout (tied weights stored once)."""
    with atomic_directory(out) as tmp:
        lm.save_pretrained(str(tmp), state_dict=state)


def save_base(lm: nn.Module, tokenizer: object, out: Path) -> None:
    with atomic_directory(out) as tmp:
        lm.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))


class MetricsWriter:
    """`metrics.jsonl`: one JSON object per logged step, flushed as it is written."""

    def __init__(self, path: Path, append: bool = False):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a" if append else "w", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


# ---------------------------------------------------------------------------------------------
# Training-state checkpoints (torch.distributed.checkpoint)
# ---------------------------------------------------------------------------------------------
#
# DIR/checkpoints/step-000040/ holds the trainable weights and optimizer state as DCP shards
# (each rank writes its own; DCP reshards on load, so a data-parallel run can resume at another
# world size), `trainer.pt` (the step and the LR scheduler) and `rng-R.pt` (rank R's RNG states).
# The data position needs no state: the rows of step s are a function of (seed, s) alone.
# All ranks write into `.step-000040.tmp`; rank 0 renames it once every rank is done, so a
# directory named step-* is always complete and a crash mid-write leaves only a temporary.
# docs/reliability.md describes the layout and what a resume restores.

CHECKPOINTS = "checkpoints"


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = Path(run_dir) / CHECKPOINTS
    steps = sorted(p for p in root.glob("step-*") if p.is_dir()) if root.is_dir() else []
    return steps[-1] if steps else None


def resume_hint(run_dir: Path) -> str:
    """What to do after a failure: the sentence naming the checkpoint a resume would start from."""
    last = latest_checkpoint(run_dir)
    if last is None:
        return f"No checkpoint was written yet: `distft train --resume {run_dir}` starts over."
    return f"The last checkpoint, {last}, is intact: `distft train --resume {run_dir}` continues from it."


def clear_checkpoints(run_dir: Path) -> None:
    """A run that starts over removes the checkpoints of the run it replaces: left in place, a
    stale `step-000040` would outrank the new run's `step-000002`, be resumed after a restart,
    and make `keep_last` prune the new checkpoints instead of the old ones."""
    shutil.rmtree(Path(run_dir) / CHECKPOINTS, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # makes the rename itself durable
    finally:
        os.close(fd)


def save_training_state(
    run_dir: Path,
    step: int,
    state: dict,
    scheduler: object,
    rank: int,
    world_size: int,
    keep_last: int,
) -> Path:
    """Write `state` (`Strategy.checkpoint_state`: weights and optimizer, this rank's shards),
    the scheduler, the step and this rank's RNG as `checkpoints/step-NNNNNN`, atomically."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step-{step:06d}"
    tmp = root / f".step-{step:06d}.tmp"
    distributed = dist.is_available() and dist.is_initialized()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash mid-write
        tmp.mkdir(parents=True)
    if distributed:
        dist.barrier()
    try:
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not distributed)
        rng = {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }
        torch.save(rng, tmp / f"rng-{rank}.pt")
        if rank == 0:
            trainer = {"step": step, "scheduler": scheduler.state_dict(), "world_size": world_size}
            torch.save(trainer, tmp / "trainer.pt")
    except Exception as err:
        # DCP gathers every rank's write result, so a failed write fails on every rank alike.
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"Writing the checkpoint of step {step} failed on rank {rank} ({_first_line(err)}); nothing was "
            f"renamed into place. {resume_hint(run_dir)} Fix the cause (disk space, permissions) first."
        ) from err
    if distributed:
        dist.barrier()
    if rank == 0:
        for f in tmp.iterdir():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
        tmp.rename(final)
        _fsync_dir(root)
        for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    if distributed:
        dist.barrier()
    return final


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def load_training_state(checkpoint: Path, state: dict, scheduler: object, rank: int) -> int:
    """Load `state` in place from `checkpoint`, restore the scheduler and this rank's RNG.

    Returns the step to resume after. The caller hands the loaded `state` back to its strategy
    (`Strategy.load_checkpoint_state`).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    distributed = dist.is_available() and dist.is_initialized()
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=not distributed)
    trainer = torch.load(checkpoint / "trainer.pt", weights_only=False)
    scheduler.load_state_dict(trainer["scheduler"])
    rng_file = checkpoint / f"rng-{rank}.pt"
    if rng_file.is_file():  # absent when resuming at a larger world size: that rank starts fresh
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return int(trainer["step"])


# Settings a resumed run may change: where and how it runs, how often it reports, how long.
RESUMABLE_CHANGES = (
    "train.max_steps", "train.eval_every", "train.eval_batches", "train.log_every", "train.device",
    "model.activation_checkpointing", "model.autocast", "data.max_rows", "train.on_nonfinite",
)  # fmt: skip


def check_resume(cfg: Config, force: bool = False) -> Path | None:
    """The checkpoint this run will resume from, or None; refuses a run dir of another config.

    `force`: resume even with output.resume=false (an elastic restart continues its own run).
    """
    from distft.config import config_differences, load_config

    out = Path(cfg.output.dir)
    checkpoint = latest_checkpoint(out) if cfg.output.resume or force else None
    if checkpoint is None or not (out / "config.toml").is_file():
        return checkpoint
    saved = load_config(out / "config.toml")
    ignore = RESUMABLE_CHANGES + tuple(
        f"{s}.{k}" for s in ("output", "parallel") for k in vars(getattr(cfg, s))
    )
    diffs = config_differences(saved, cfg, ignore=ignore)
    if diffs:
        raise ConfigError(
            f"{out} holds a run with a different config, and its checkpoint {checkpoint.name} would resume "
            f"into it ({'; '.join(diffs)}). Use another --out, or output.resume=false to start over there."
        )
    return checkpoint


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop metrics lines past `last_step` (written after the checkpoint a run resumes from)."""
    if not path.is_file():
        return

    def keep(line: str) -> bool:
        try:
            return json.loads(line)["step"] <= last_step
        except (json.JSONDecodeError, KeyError):
            return False  # a line cut short by the crash

    lines = [line for line in path.read_text().splitlines() if keep(line)]
    atomic_write_text(path, "".join(line + "\n" for line in lines))


# ---------------------------------------------------------------------------------------------
# Before launch: can the run write its outputs?
# ---------------------------------------------------------------------------------------------


def output_bytes(cfg: Config, model_config: PretrainedConfig) -> dict[str, int]:
    """Estimated bytes each kind of output takes at its largest, from the architecture alone.

    The model is built on the meta device (no memory, no weights) to count parameters. A
    checkpoint holds the trainable weights and AdamW's two moments, all in the model dtype;
    keep_last + 1 exist while a new one is written; the exported adapter (or model) exists twice
    while it is replaced; a preset's base is saved once.
    """
    from transformers import AutoModelForCausalLM

    from distft.model import DTYPES, is_preset

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
    if is_preset(cfg.model.name) and cfg.output.save_base:
        sizes["base"] = total * itemsize
    return sizes


def check_output_dir(cfg: Config, model_config: PretrainedConfig) -> None:
    """Refuse, before anything is launched, an output directory that cannot be written or lacks
    the space for the run's outputs (`output_bytes`)."""
    import tempfile

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
