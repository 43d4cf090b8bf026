"""Training-state checkpoints (torch.distributed.checkpoint), and what a resume starts from.

DIR/checkpoints/step-000040/ holds the trainable weights and optimizer state as DCP shards (each
rank writes its own; DCP reshards on load, so a data-parallel run can resume at another world
size), `trainer.json` (the step, the LR scheduler and the loop's own state: early stopping's best
validation loss, `distft.train.early_stopping`) and `rng-R.safetensors` (rank R's RNG states).
A run's last step is checkpointed before its validation, its record kept as pending; the state
after that validation goes beside it, into `validated.json` (`record_validation`).
The data position needs no state: the rows of step s are a function of (seed, s) alone.

A checkpoint is data, never code: DCP's own pickles and earlier versions' `trainer.pt`/`rng-R.pt`
are read by `distft.io.safe_load`, which builds nothing but checkpoint data.

All ranks write into `.step-000040.tmp`; rank 0 writes its `manifest.json` (every file's size and
SHA-256) and renames it once every rank is done, so a directory named step-* is always complete and
a crash mid-write leaves only a temporary. A checkpoint damaged later (a file cut short by a copy,
a disk error) fails its manifest: a resume skips it, saying so, for the newest intact one.
docs/reliability.md describes the layout and what a resume restores.
"""

from __future__ import annotations

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
from torch.distributed.checkpoint.api import CheckpointException

from distft.config import Config, config_differences, load_config
from distft.errors import CheckpointError, ConfigError, DamagedFileError
from distft.io.files import add_to_manifest, atomic_write_text, damage, write_manifest
from distft.io.param_groups import PACKED, packed, to_load, unpacked
from distft.io.safe_load import ForbiddenPickle, SafeLoadPlanner, SafeReader, load_weights_only, read_metadata

CHECKPOINTS = "checkpoints"
VALIDATED = "validated.json"  # the loop's state after a validation that ran after the checkpoint


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


def checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    return sorted(p for p in root.glob("step-*") if p.is_dir()) if root.is_dir() else []


def latest_checkpoint(run_dir: Path) -> Path | None:
    steps = checkpoints(run_dir)
    return steps[-1] if steps else None


def checkpoint_damage(checkpoint: Path) -> str | None:
    """What makes `checkpoint` unusable (a file its manifest does not vouch for, an unreadable
    trainer state or metadata), or None. A planted pickle is not damage: it raises
    `ForbiddenPickle`, and the resume is refused rather than quietly skipped."""
    problem = damage(checkpoint)
    if problem is not None:
        return problem
    try:
        if problem := _shards_short(checkpoint, read_metadata(checkpoint)):
            return problem
        trainer = _read_trainer(checkpoint)
        if (
            not isinstance(trainer, dict)
            or not isinstance(trainer.get("step"), int)
            or "scheduler" not in trainer
        ):
            return "its trainer state holds no step and scheduler"
    except ForbiddenPickle as err:
        raise CheckpointError(_refusal(checkpoint, err)) from None
    except (OSError, EOFError, ValueError, KeyError, TypeError, pickle.UnpicklingError, RuntimeError) as err:
        return _first_line(err)
    return None


def _shards_short(checkpoint: Path, metadata: object) -> str | None:
    """A shard file missing, or shorter than the bytes DCP's metadata places in it: found even in a
    checkpoint without a manifest (written by an earlier version)."""
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        if getattr(info, "relative_path", None):
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = checkpoint / name
        if not shard.is_file():
            return f"{name} is missing"
        if shard.stat().st_size < size:
            return f"{name} has {shard.stat().st_size:,} bytes, and its metadata places {size:,} in it (cut short)"
    return None


def set_aside_newer(run_dir: Path, checkpoint: Path) -> None:
    """Rename the checkpoints newer than `checkpoint` (the damaged ones a resume skipped) to
    `.damaged-step-NNNNNN`: kept for a look, never resumed, pruned or written over."""
    for newer in checkpoints(run_dir):
        if newer.name > checkpoint.name:
            newer.rename(newer.with_name(f".damaged-{newer.name}"))


def intact_checkpoint(run_dir: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that is not damaged, and a note for each newer one skipped."""
    skipped = []
    for checkpoint in reversed(checkpoints(run_dir)):
        problem = checkpoint_damage(checkpoint)
        if problem is None:
            return checkpoint, skipped
        skipped.append(f"skipped the damaged checkpoint {checkpoint.name} ({problem})")
    return None, skipped


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
    loop: dict | None = None,
) -> Path:
    """Write `state` (`Strategy.checkpoint_state`: weights and optimizer, this rank's shards),
    the scheduler, the step, the loop's state (`loop`: JSON, rank 0's; `read_loop_state`) and this
    rank's RNG as `checkpoints/step-NNNNNN`, atomically."""
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
            packed_state = {**state, "optim": packed(state["optim"])}  # `distft.io.param_groups`
            dcp.save(packed_state, checkpoint_id=str(tmp), no_dist=not distributed)
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
        save_file(rng, tmp / f"rng-{rank}.safetensors")
        if rank == 0:
            trainer = {"step": step, "scheduler": scheduler.state_dict(), "world_size": world_size}
            if loop is not None:
                trainer["loop"] = loop
            (tmp / "trainer.json").write_text(json.dumps(trainer))
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        # DCP gathers every rank's write result, so a failed write fails on every rank alike.
        raise _write_failed(run_dir, tmp, step, rank, err) from err
    if distributed:
        dist.barrier()
    if rank == 0:
        try:
            write_manifest(tmp)  # every rank's files are there (the barrier): sizes and checksums
            for f in tmp.iterdir():
                with f.open("rb") as fh:
                    os.fsync(fh.fileno())
        except OSError as err:  # a disk that fills while the manifest is written
            raise _write_failed(run_dir, tmp, step, rank, err) from err
        tmp.rename(final)
        _fsync_dir(root)
        for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    if distributed:
        dist.barrier()
    return final


def _write_failed(
    run_dir: str | Path, tmp: Path, step: int, rank: int, err: BaseException
) -> CheckpointError:
    """The temporary gone (rank 0's to remove), and the one line that says the last checkpoint stands."""
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    return CheckpointError(
        f"Writing the checkpoint of step {step} failed on rank {rank} ({_first_line(_cause(err))}); nothing "
        f"was renamed into place. {resume_hint(run_dir)} Fix the cause (disk space, permissions) first."
    )


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
        # Refused here, before DCP's own tracebacks; packed: `distft.io.param_groups`.
        is_packed = f"optim.{PACKED}" in read_metadata(checkpoint).state_dict_metadata
        loading = {**state, "optim": to_load(state["optim"])} if is_packed else state
        with _single_process_quietly():
            dcp.load(
                loading,
                storage_reader=SafeReader(checkpoint),
                planner=SafeLoadPlanner(),
                no_dist=not distributed,
            )
        if is_packed:
            state["optim"] = unpacked(loading["optim"], state["optim"])
        trainer = _read_trainer(checkpoint)
        rng = _read_rng(checkpoint, rank)
    except (CheckpointException, pickle.UnpicklingError, RuntimeError, ValueError, OSError, KeyError) as err:
        raise CheckpointError(_refusal(checkpoint, _cause(err))) from None
    scheduler.load_state_dict(trainer["scheduler"])
    if rng is not None:  # absent when resuming at a larger world size: that rank starts fresh
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return int(trainer["step"])


def read_loop_state(checkpoint: Path) -> dict:
    """The loop's state saved with `checkpoint` (`save_training_state`'s `loop`, or what
    `record_validation` wrote after it); {} from a checkpoint written before there was one. Read
    after `load_training_state` vouched for the file."""
    validated = checkpoint / VALIDATED
    loop = json.loads(validated.read_text()) if validated.is_file() else _read_trainer(checkpoint).get("loop")
    return loop if isinstance(loop, dict) else {}


def record_validation(checkpoint: Path, loop: dict) -> None:
    """The loop's state after the validation of `checkpoint`'s step, which ran after it was written
    (its `loop` holds the state before, and the step's record as pending): a file of its own,
    written atomically and then added to the manifest, so that the checkpoint is complete at every
    moment (rank 0's)."""
    atomic_write_text(checkpoint / VALIDATED, json.dumps(loop))
    add_to_manifest(checkpoint, VALIDATED)


def _refusal(checkpoint: Path, err: BaseException) -> str:
    return (
        f"{checkpoint} cannot be resumed: {_first_line(err)}. A checkpoint is read as data only (no "
        "pickled code runs); if this one came from elsewhere, it is damaged or not a distft checkpoint. "
        "Resume from another run, or start over with output.resume=false."
    )


def _cause(err: BaseException) -> BaseException:
    """What failed inside DCP's per-rank wrapper (a `CheckpointException`), else `err` itself."""
    failures = getattr(err, "failures", None) if isinstance(err, CheckpointException) else None
    return next(iter(failures.values()))[0] if failures else err


def _read_trainer(checkpoint: Path) -> dict:
    if (checkpoint / "trainer.json").is_file():
        return json.loads((checkpoint / "trainer.json").read_text())
    return load_weights_only(checkpoint / "trainer.pt")  # an earlier version's


def _read_rng(checkpoint: Path, rank: int) -> dict | None:
    new, old = checkpoint / f"rng-{rank}.safetensors", checkpoint / f"rng-{rank}.pt"
    if new.is_file():
        tensors = load_file(new)
        cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda.")), key=_index)]
        return {"torch": tensors["torch"], "cuda": cuda}
    return load_weights_only(old) if old.is_file() else None  # an earlier version's


def _index(key: str) -> int:
    return int(key.split(".")[1])


# Settings a resumed run may change: where and how it runs, how often it reports, how long.
RESUMABLE_CHANGES = (
    "train.max_steps", "train.eval_every", "train.eval_batches", "train.log_every", "train.device",
    "model.activation_checkpointing", "model.autocast", "data.max_rows", "train.on_nonfinite",
    "train.straggler_window", "train.straggler_ratio", "train.checkpoint_on_signal",
)  # fmt: skip


def check_resume(cfg: Config, force: bool = False, skipped: list[str] | None = None) -> Path | None:
    """The checkpoint this run will resume from, or None; refuses a run dir of another config, and
    one whose every checkpoint is damaged (starting over would delete them).

    `force`: resume even with output.resume=false or output.overwrite=true (an elastic restart
    continues its own run). `skipped` collects a note for each damaged checkpoint passed over.
    """
    out = Path(cfg.output.dir)
    wanted = cfg.output.resume and not cfg.output.overwrite
    latest = latest_checkpoint(out) if wanted or force else None
    if latest is None:
        return None
    if (out / "config.toml").is_file():  # another run's checkpoints: named before any is read
        saved = load_config(out / "config.toml", run=True)
        ignore = RESUMABLE_CHANGES + tuple(
            f"{s}.{k}" for s in ("output", "parallel") for k in vars(getattr(cfg, s))
        )
        diffs = config_differences(saved, cfg, ignore=ignore)
        if diffs:
            raise ConfigError(
                f"{out} holds a run with a different config, and its checkpoint {latest.name} would resume "
                f"into it ({'; '.join(diffs)}). Use another --out, or output.resume=false to start over there."
            )
    checkpoint, passed_over = intact_checkpoint(out)
    if checkpoint is None:
        raise DamagedFileError(
            f"{out} holds checkpoints, and every one is damaged: {'; '.join(passed_over)}. Nothing was "
            "changed. Restore the files, or start over with output.resume=false (which deletes them)."
        )
    if skipped is not None:
        skipped.extend(passed_over)
    return checkpoint
