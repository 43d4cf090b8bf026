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

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from torch import nn

if TYPE_CHECKING:
    from distft.config import Config


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temporary directory that replaces `final` only if the block completes."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.iterdir():  # data on disk before the rename makes it visible
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_adapter(
    peft_model: nn.Module,
    state: dict[str, torch.Tensor],
    out: Path,
    base_ref: str,
    quantization: dict | None = None,
) -> None:
    """Write `state` (the trained LoRA weights, peft's full names) as a PEFT adapter in `out`.

    A QLoRA adapter also gets `quantization.json` (`distft.quant`): it was trained against the
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
            from distft.quant import QUANTIZATION_FILE

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
# world size), plus `trainer.pt`: the step, the LR scheduler, and every rank's RNG states.
# All ranks write into `.step-000040.tmp`; rank 0 renames it once every rank is done, so a
# directory named step-* is always complete and a crash mid-write leaves only a temporary.

CHECKPOINTS = "checkpoints"


def _state_dict_options(full: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Frozen base weights are rebuilt from the model source on resume; saving them would copy
    # the whole base model into every checkpoint. strict=False because the model then has keys
    # (the frozen ones) that the checkpoint does not. The optimizer state is flattened to one key
    # per parameter name (`param_groups.<fqn>.lr`, ...): unflattened, param_groups is one list of
    # names per rank under a single key, which DCP stores once, so ranks that hold different
    # parameters (pipeline stages) would load each other's groups.
    return StateDictOptions(
        ignore_frozen_params=True, strict=False, full_state_dict=full, flatten_optimizer_state_dict=True
    )


def _without_frozen(model: nn.Module, state: dict) -> dict:
    """Drop frozen parameters under every name. `ignore_frozen_params` drops each under one name
    only, and `SummaryLM` reaches the backbone and lm_head under a second one (`backbone.*`,
    `lm_head.*`): without this a LoRA checkpoint holds the whole frozen base, and a QLoRA one
    holds NF4 weights that DCP cannot load back (it narrows them, which NF4Tensor refuses)."""
    frozen = {
        name.removeprefix("module.")  # DDP's wrapper; get_state_dict's names omit it
        for name, p in model.named_parameters(remove_duplicate=False)
        if not p.requires_grad
    }
    return {k: v for k, v in state.items() if k not in frozen}


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = Path(run_dir) / CHECKPOINTS
    steps = sorted(p for p in root.glob("step-*") if p.is_dir()) if root.is_dir() else []
    return steps[-1] if steps else None


def save_training_state(
    run_dir: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: object,
    rank: int,
    world_size: int,
    keep_last: int,
) -> Path:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step-{step:06d}"
    tmp = root / f".step-{step:06d}.tmp"
    distributed = dist.is_available() and dist.is_initialized()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if distributed:
        dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer, options=_state_dict_options())
    model_state = _without_frozen(model, model_state)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp), no_dist=not distributed)
    rng = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    torch.save(rng, tmp / f"rng-{rank}.pt")
    if rank == 0:
        torch.save(
            {"step": step, "scheduler": scheduler.state_dict(), "world_size": world_size}, tmp / "trainer.pt"
        )
    if distributed:
        dist.barrier()
    if rank == 0:
        for f in tmp.iterdir():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
        tmp.rename(final)
        for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    if distributed:
        dist.barrier()
    return final


def load_training_state(
    checkpoint: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: object, rank: int
) -> int:
    """Restore weights, optimizer, scheduler and this rank's RNG; return the step to resume after."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    distributed = dist.is_available() and dist.is_initialized()
    model_state, optim_state = get_state_dict(model, optimizer, options=_state_dict_options())
    model_state = _without_frozen(model, model_state)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=not distributed)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_state_dict_options(),
    )
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
    "model.activation_checkpointing", "model.autocast", "data.max_rows",
)  # fmt: skip


def check_resume(cfg: Config) -> Path | None:
    """The checkpoint this run will resume from, or None; refuses a run dir of another config."""
    from distft.config import ConfigError, config_differences, load_config

    out = Path(cfg.output.dir)
    checkpoint = latest_checkpoint(out) if cfg.output.resume else None
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
    lines = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= last_step]
    atomic_write_text(path, "".join(line + "\n" for line in lines))
