"""Files written so that a crash never leaves a half-written one where a good one was.

A file or directory is written under a temporary name beside its final place, flushed to disk, and
renamed into place once complete (a rename within one filesystem is atomic), so a reader sees the
old version or the new one, never a mix.

A directory also gets `manifest.json`: every file's size and SHA-256, written last, before the
rename. A rename is atomic, but a disk, a copy (`cp -r`, `rsync` cut short) or a person can still
damage a file later; `verify_directory` finds it and names it, instead of a reader failing deep
inside safetensors or JSON. Directories written before manifests existed are read unverified.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from distft.errors import DamagedFileError

MANIFEST = "manifest.json"


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
        write_manifest(tmp)
        for f in _files(tmp):  # data on disk before the rename makes it visible
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_text_file(path: Path) -> Iterator[TextIO]:
    """Yield a text file that replaces `path` only if the block completes (written as it goes)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path (same directory, same suffix) for a writer that takes a path
    (matplotlib's `savefig`); it replaces `path` only if the block completes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        yield tmp
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_text_file(path) as f:
        f.write(text)


# ---- manifests: what a complete directory holds ------------------------------------------------


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in Path(directory).rglob("*") if p.is_file())


def file_digest(path: Path) -> str:
    """SHA-256 of a file, read in 16 MiB blocks (about 1 GB/s on one core)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path, only: list[Path] | None = None) -> None:
    """`directory/manifest.json`: each file's size and SHA-256, by its path inside `directory`
    (every file, or those in `only`: a report's files beside the runs that hold their own)."""
    directory = Path(directory)
    files = {
        p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, "sha256": file_digest(p)}
        for p in (sorted(Path(f) for f in only) if only is not None else _files(directory))
        if p.name != MANIFEST
    }
    with atomic_text_file(directory / MANIFEST) as f:
        json.dump({"files": files}, f, indent=1)


def add_to_manifest(directory: Path, name: str) -> None:
    """Add the file `name`, written after `directory`'s manifest, to that manifest (no other file
    is read again); until then it is a file the manifest does not vouch for, which no check fails."""
    path = Path(directory) / MANIFEST
    listed = json.loads(path.read_text(encoding="utf-8"))
    added = Path(directory) / name
    listed["files"][name] = {"bytes": added.stat().st_size, "sha256": file_digest(added)}
    with atomic_text_file(path) as f:
        json.dump(listed, f, indent=1)


def damage(directory: Path) -> str | None:
    """What is wrong with `directory` by its manifest (a missing, cut short or altered file), or
    None when every file is as written, or when the directory has no manifest (written before
    manifests existed)."""
    directory = Path(directory)
    try:
        listed = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))["files"]
        listed = {str(name): (int(f["bytes"]), str(f["sha256"])) for name, f in listed.items()}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"its {MANIFEST} is damaged"
    for name, (size, sha256) in sorted(listed.items()):
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size:,} bytes, {size:,} when written (cut short or altered)"
        if file_digest(path) != sha256:
            return f"{name} does not match the checksum it was written with (altered or damaged)"
    return None


def verify_directory(directory: Path, what: str, fix: str) -> None:
    """Raise `DamagedFileError` naming the damaged file of `directory` (`what` names the directory
    to the user, `fix` says what to do)."""
    problem = damage(directory)
    if problem is not None:
        raise DamagedFileError(f"{what} {directory} is damaged: {problem}. {fix}")
