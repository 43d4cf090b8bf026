"""Training-state checkpoints (torch.distributed.checkpoint), and what a resume starts from.

DIR/checkpoints/step-000040/ holds the trainable weights and optimizer state as DCP shards (each
rank writes its own; DCP reshards on load, so a data-parallel run can resume at another world
size), `trainer.pt` (the step and the LR scheduler) and `rng-R.pt` (rank R's RNG states). The
data position needs no state: the rows of step s are a function of (seed, s) alone.

All ranks write into `.step-000040.tmp`; rank 0 renames it once every rank is done, so a directory
named step-* is always complete and a crash mid-write leaves only a temporary.
docs/reliability.md describes the layout and what a resume restores.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

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
    distributed = dist.is_available() and dist.is_initialized()
    with _single_process_quietly():
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
