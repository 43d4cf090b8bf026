"""Training-state checkpoints (torch.distributed.checkpoint), and what a resume starts from.

DIR/checkpoints/step-000040/ holds the trainable weights and optimizer state as DCP shards (each
rank writes its own; DCP reshards on load, so a data-parallel run can resume at another world
size), `trainer.json` (the step and the LR scheduler) and `rng-R.safetensors` (rank R's RNG
states). The data position needs no state: the rows of step s are a function of (seed, s) alone.

A checkpoint is data, never code: resuming one from anyone (a colleague's run, a shared
filesystem) must not run what a planted pickle asks for. DCP itself pickles two things: its
`.metadata` (read here by an unpickler that builds only DCP's own metadata classes, torch sizes and
dtypes, and paths) and non-tensor optimizer values (read with `torch.load(weights_only=True)`).
Checkpoints of earlier versions (`trainer.pt`, `rng-R.pt`) still resume, through `weights_only=True`.

All ranks write into `.step-000040.tmp`; rank 0 renames it once every rank is done, so a directory
named step-* is always complete and a crash mid-write leaves only a temporary.
docs/reliability.md describes the layout and what a resume restores.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import pickle
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from distft.config import Config, config_differences, load_config
from distft.errors import CheckpointError, ConfigError

CHECKPOINTS = "checkpoints"


@contextmanager
def _single_process_quietly() -> Iterator[None]:
    """DCP warns on every single-process save/load that it "assumes" one process; distft passes
    no_dist=True on purpose there, so that one message is silenced around those calls only."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to",
            category=UserWarning,
        )
        yield


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
        with _single_process_quietly():
            dcp.save(state, checkpoint_id=str(tmp), no_dist=not distributed)
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
        save_file(rng, tmp / f"rng-{rank}.safetensors")
        if rank == 0:
            trainer = {"step": step, "scheduler": scheduler.state_dict(), "world_size": world_size}
            (tmp / "trainer.json").write_text(json.dumps(trainer))
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
    (`Strategy.load_checkpoint_state`). Nothing read here can run code (the module docstring).
    """
    distributed = dist.is_available() and dist.is_initialized()
    try:
        read_metadata(checkpoint)  # refused here, before DCP would log its own tracebacks about it
        with _single_process_quietly():
            dcp.load(
                state,
                storage_reader=SafeReader(checkpoint),
                planner=SafeLoadPlanner(),
                no_dist=not distributed,
            )
        trainer = _read_trainer(checkpoint)
        rng = _read_rng(checkpoint, rank)
    except (CheckpointException, pickle.UnpicklingError, RuntimeError, ValueError, OSError, KeyError) as err:
        raise CheckpointError(
            f"{checkpoint} cannot be resumed: {_first_line(_cause(err))}. A checkpoint is read as data only "
            "(no pickled code runs); if this one came from elsewhere, it is damaged or not a distft "
            "checkpoint. Resume from another run, or start over with output.resume=false."
        ) from None
    scheduler.load_state_dict(trainer["scheduler"])
    if rng is not None:  # absent when resuming at a larger world size: that rank starts fresh
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return int(trainer["step"])


def _cause(err: BaseException) -> BaseException:
    """What failed inside DCP's per-rank wrapper (a `CheckpointException`), else `err` itself."""
    failures = getattr(err, "failures", None) if isinstance(err, CheckpointException) else None
    return next(iter(failures.values()))[0] if failures else err


def _read_trainer(checkpoint: Path) -> dict:
    if (checkpoint / "trainer.json").is_file():
        return json.loads((checkpoint / "trainer.json").read_text())
    return torch.load(checkpoint / "trainer.pt", weights_only=True)  # an earlier version's


def _read_rng(checkpoint: Path, rank: int) -> dict | None:
    new, old = checkpoint / f"rng-{rank}.safetensors", checkpoint / f"rng-{rank}.pt"
    if new.is_file():
        tensors = load_file(new)
        cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda.")), key=_index)]
        return {"torch": tensors["torch"], "cuda": cuda}
    return torch.load(old, weights_only=True) if old.is_file() else None  # an earlier version's


def _index(key: str) -> int:
    return int(key.split(".")[1])


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and nothing else: a planted `.metadata` asking for any other callable
    (`os.system`, ...) fails to load instead of running it."""

    def find_class(self, module: str, name: str) -> object:
        found = super().find_class(module, name) if _allowed(module, name) else None
        if found is None:
            raise pickle.UnpicklingError(
                f"its .metadata asks for {module}.{name}, which is not checkpoint metadata"
            )
        return found


def _allowed(module: str, name: str) -> bool:
    if module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"):
        return isinstance(getattr(importlib.import_module(module), name, None), type)  # classes only
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
    return (module, name) in {
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
    }


def read_metadata(checkpoint: Path) -> Metadata:
    """A checkpoint's DCP `.metadata`, read by `_MetadataUnpickler`."""
    with (checkpoint / ".metadata").open("rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError("its .metadata holds no checkpoint metadata")
    return metadata


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with the metadata read by `_MetadataUnpickler`."""

    def read_metadata(self, *args: object) -> Metadata:  # no **kwargs: no per-rank fallback file
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor values (optimizer settings) read by `weights_only=True`."""

    def load_bytes(self, read_item: object, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


# Settings a resumed run may change: where and how it runs, how often it reports, how long.
RESUMABLE_CHANGES = (
    "train.max_steps", "train.eval_every", "train.eval_batches", "train.log_every", "train.device",
    "model.activation_checkpointing", "model.autocast", "data.max_rows", "train.on_nonfinite",
    "train.checkpoint_on_signal",
)  # fmt: skip


def check_resume(cfg: Config, force: bool = False) -> Path | None:
    """The checkpoint this run will resume from, or None; refuses a run dir of another config.

    `force`: resume even with output.resume=false or output.overwrite=true (an elastic restart
    continues its own run).
    """
    out = Path(cfg.output.dir)
    wanted = cfg.output.resume and not cfg.output.overwrite
    checkpoint = latest_checkpoint(out) if wanted or force else None
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
