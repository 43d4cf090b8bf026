"""Tokenise once: a dataset's examples in a memory-mapped store (`distft.data.store`) that every
rank, and every later run with the same key, opens instead of tokenising.

Key: a sha256 over everything that decides the tokens and the split: the tokenizer
(`tokenizer_fingerprint`: vocabulary, merges, added tokens, chat template: `data.chat_template`'s
where set), the data (a file's
path, size and modification time; a hub set's id, splits and `data.revision`), every `data.*`
setting but those that change neither (packing, the cache's own settings), `train.seed` (which
rows are held out), and the code that turns rows into a store (this module too). The store lives in
`<data.cache_dir>/<source>-<key>`; a change to any of these is a new key and a new store.

Build: `distft train` builds it before launch, so ranks only open it. A process that finds none
(the Python API, another node's disk) takes a file lock, so one process per node builds it while
the others wait, into a temporary directory renamed into place once complete: a crash leaves a
temporary directory (swept by the next build on that host), never a half store under the key.
A run with in-memory rows (`train(cfg, dataset=...)`) or `data.cache=false` tokenises in memory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import tokenizers
import transformers

from distft.config import DataConfig
from distft.data import chat, files, formats, mixture, rows, store, truncation
from distft.data.chat import ENCODE_CHUNK, ChatFormatter, TokenizedSplit, tokenize_rows
from distft.data.chat_template import with_chat_template
from distft.data.formats import Row
from distft.data.mixture import data_name, mix_splits, source_configs
from distft.data.rows import check_splits, held_out, is_local, load_rows, row_source
from distft.data.sample import is_sample, sample_files
from distft.data.store import META, CachedSplit, StoreWriter, open_store
from distft.data.tokenizer import cache_root, tokenizer_fingerprint
from distft.errors import DataError

# Settings that change neither the tokens nor the split: not in the key.
NOT_IN_KEY = ("packing", "cache", "cache_dir", "streaming")
SKIPPED = -2  # example numbers at or below it: rows skipped as too long (data.skip_long_rows)
Progress = Callable[[int], None]  # examples tokenised so far; called once per chunk while building


@dataclass
class TokenCache:
    path: Path
    state: str  # "hit": opened a store built before; "built": tokenised it now
    seconds: float  # to open, or to build and open
    train: CachedSplit
    validation: CachedSplit


# ---- the key ----------------------------------------------------------------------------------


def _file_identity(path: Path) -> dict:
    stat = path.stat()
    return {"path": str(path.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def source_identity(cfg: DataConfig) -> dict:
    """What the data is known by, read without opening it: a local file by path, size and
    modification time; a hub set by id (its splits and `data.revision` are settings); a mixture
    by each of its sources (their weights and formats are settings)."""
    if cfg.sources:
        return {"mixture": [source_identity(sub) for sub in source_configs(cfg)]}
    if is_sample(cfg.source):
        return {"files": [_file_identity(path) for path in sample_files(cfg.source)]}
    if is_local(cfg):
        files.check_is_file(Path(cfg.source))
        return {"files": [_file_identity(Path(cfg.source))]}
    return {"hub": cfg.source}


def _code_fingerprint() -> str:
    """The modules that turn records into rows, rows into tokens and tokens into a store, and the
    libraries under them (transformers renders the chat template and calls the tokenizer)."""
    h = hashlib.sha256(
        f"transformers {transformers.__version__} tokenizers {tokenizers.__version__}".encode()
    )
    for module in (formats, files, chat, truncation, rows, mixture, store):
        h.update(Path(module.__file__).read_bytes())
    h.update(Path(__file__).read_bytes())  # this module: which rows are kept, the splits' order
    return h.hexdigest()


def cache_key(cfg: DataConfig, seed: int, tokenizer: Any) -> dict:
    """Everything that decides a store's contents (its sha256 names the directory)."""
    return {
        "store": store.STORE_VERSION,
        "code": _code_fingerprint(),
        "tokenizer": tokenizer_fingerprint(with_chat_template(tokenizer, cfg.chat_template)),  # as rendered
        "source": source_identity(cfg),
        "data": {k: v for k, v in asdict(cfg).items() if k not in NOT_IN_KEY},
        "seed": seed,
    }


def cache_path(cfg: DataConfig, key: dict) -> Path:
    root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else cache_root() / "tokens"
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", "mixture" if cfg.sources else Path(cfg.source).name)[
        :40
    ]  # a reader's hint, not the key
    return root / f"{name}-{digest[:20]}"


# ---- the build --------------------------------------------------------------------------------


def _tokenise(
    rows_in: Iterator[Row], keep: Callable[[int], bool], formatter: ChatFormatter, writer: StoreWriter,
    skipped: list[str], progress: Progress | None,
) -> np.ndarray:  # fmt: skip
    """Tokenise the rows `keep` selects into `writer`, in order; every row is still read (and a
    malformed one refused). Returns each row's example number: -1 not kept, and `SKIPPED - j` a
    row skipped as too long (data.skip_long_rows) whose origin is `skipped[j]`."""
    numbers, chunk = array("q"), []

    def flush() -> None:
        kept = []
        for (i, row), example in zip(chunk, formatter.encode_many([r for _, r in chunk]), strict=True):
            if example is None:
                numbers[i] = SKIPPED - len(skipped)
                skipped.append(row.origin)
            else:
                numbers[i] = len(writer) + len(kept)
                kept.append(example)
        writer.add(kept)
        chunk.clear()
        if progress:
            progress(len(writer))

    for i, row in enumerate(rows_in):
        numbers.append(-1)
        if keep(i):
            chunk.append((i, row))
        if len(chunk) == ENCODE_CHUNK:
            flush()
    flush()
    return np.frombuffer(numbers, dtype=np.int64)


def _keep(part: str, read: Callable[[], Iterator[Row]], cfg: DataConfig, seed: int) -> Callable[[int], bool]:
    """Which rows of a part training uses: with `data.max_rows`, the first rows of a train split,
    or (a part cut by `held_out`) the held-out rows and the first training ones, which takes a
    first pass to count the rows. Without it (or in a mixture), every row."""
    if not cfg.max_rows or part == "validation" or cfg.sources:
        return lambda i: True
    if part == "train":
        return lambda i: i < cfg.max_rows
    n = sum(1 for _ in read())
    train, valid = held_out(n, cfg.validation_fraction, seed)
    wanted = np.zeros(n, dtype=bool)
    wanted[train[: cfg.max_rows].numpy()] = True
    wanted[valid.numpy()] = True
    return lambda i: bool(wanted[i])


def _splits(
    numbers: dict[str, np.ndarray], cfg: DataConfig, seed: int, too_few: str
) -> dict[str, np.ndarray]:
    """Each split's example numbers, in the order `distft.data.rows` gives its rows (skipped rows
    still in, as their negative markers)."""
    if "all" not in numbers:
        return {"train": numbers["train"], "validation": numbers["validation"]}
    n = len(numbers["all"])
    if too_few and n < 2:
        raise DataError(too_few.format(n=n))
    train, valid = (numbers["all"][p.numpy()] for p in held_out(n, cfg.validation_fraction, seed))
    return {"train": train, "validation": valid}


def _source_splits(
    cfg: DataConfig, seed: int, formatter: ChatFormatter, writer: StoreWriter, skipped: list[str],
    progress: Progress | None,
) -> dict[str, np.ndarray]:  # fmt: skip
    """One source's rows tokenised into `writer`, and its splits' example numbers."""
    source = row_source(cfg)
    numbers = {
        part: _tokenise(read(), _keep(part, read, cfg, seed), formatter, writer, skipped, progress)
        for part, read in source.parts.items()
    }
    return _splits(numbers, cfg, seed, source.too_few)


def build_store(
    folder: Path, cfg: DataConfig, seed: int, tokenizer: Any, key: dict, progress: Progress | None
) -> None:
    """Tokenise `cfg.source` (or each of `cfg.sources`, then mixed) into a new store in `folder`."""
    start = time.perf_counter()
    formatter, writer, skipped = ChatFormatter(tokenizer, cfg), StoreWriter(folder), []
    if cfg.sources:
        parts = [
            _source_splits(sub, seed, formatter, writer, skipped, progress) for sub in source_configs(cfg)
        ]
        splits = mix_splits(parts, cfg, seed)
    else:
        splits = _source_splits(cfg, seed, formatter, writer, skipped, progress)
    if cfg.max_rows:
        splits["train"] = splits["train"][: cfg.max_rows]
    dropped = {}
    for name, numbers in splits.items():  # the skipped rows leave the split, named by origin
        dropped[name] = [skipped[SKIPPED - k] for k in numbers[numbers <= SKIPPED].tolist()]
        splits[name] = numbers[numbers > SKIPPED]
    check_splits(len(splits["train"]), len(splits["validation"]), data_name(cfg))
    built = {"build_s": round(time.perf_counter() - start, 3), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    writer.close(splits, {"key": key, **built}, dropped)


# ---- one build per key ------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created if missing), held for the block. Processes on one
    host exclude each other; across hosts it holds where the shared filesystem supports locks, and
    where it does not, two builds race to one rename (`_build_once`) and the loser's copy is dropped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = path.open("a+b")
    except OSError as err:
        raise DataError(
            f"Cannot write the token cache in {path.parent} ({err.strerror}): set data.cache_dir to a "
            "writable directory, or data.cache=false."
        ) from None
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


def _sweep(final: Path, host: str) -> None:
    """Remove temporary directories that builds on this host left when they died."""
    for tmp in final.parent.glob(f".{final.name}.tmp-{host}-*"):
        pid = tmp.name.rpartition("-")[2]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _build_once(
    final: Path, cfg: DataConfig, seed: int, tokenizer: Any, key: dict, progress: Progress | None
) -> bool:
    """Build the store `final` unless another process has (or does, while this one waits for the
    lock); True if this process built it."""
    with _locked(final.parent / f".{final.name}.lock"):
        if (final / META).is_file():
            return False
        host = socket.gethostname()
        _sweep(final, host)
        tmp = final.parent / f".{final.name}.tmp-{host}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            build_store(tmp, cfg, seed, tokenizer, key, progress)
            with contextlib.suppress(OSError):  # another node's build won: ours is identical
                tmp.rename(final)  # atomic: the key names a complete store or nothing
        except OSError as err:
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DataError(
                    f"The token cache filled {final.parent} ({err.strerror}): free space there, set "
                    "data.cache_dir to a larger disk, or data.cache=false."
                ) from None
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return True


def open_or_build(cfg: DataConfig, seed: int, tokenizer: Any, progress: Progress | None = None) -> TokenCache:
    """The store of this key: opened if it exists, else built once (one process per node)."""
    start = time.perf_counter()
    key = cache_key(cfg, seed, tokenizer)
    final = cache_path(cfg, key)
    built = not (final / META).is_file() and _build_once(final, cfg, seed, tokenizer, key, progress)
    try:
        splits = open_store(final)
    except (ValueError, KeyError, OSError) as err:
        raise DataError(
            f"The token cache {final} is damaged ({err}); delete that directory and run again."
        ) from None
    state = "built" if built else "hit"
    return TokenCache(final, state, time.perf_counter() - start, splits["train"], splits["validation"])


def tokenized_splits(
    cfg: DataConfig, seed: int, tokenizer: Any, dataset: Any = None, progress: Progress | None = None
) -> tuple[TokenizedSplit | CachedSplit, TokenizedSplit | CachedSplit, dict]:
    """The train and validation examples of a run, and how they were had: {"state": hit | built
    (the cache), memory (tokenised here: in-memory rows, or data.cache=false), "path", "seconds"}."""
    if dataset is None and cfg.cache:
        cache = open_or_build(cfg, seed, tokenizer, progress)
        info = {"state": cache.state, "path": str(cache.path), "seconds": round(cache.seconds, 3)}
        return cache.train, cache.validation, info
    start = time.perf_counter()
    formatter = ChatFormatter(tokenizer, cfg)
    splits = load_rows(cfg, seed, dataset)
    train, valid = tokenize_rows(splits["train"], formatter), tokenize_rows(splits["validation"], formatter)
    check_splits(len(train), len(valid), data_name(cfg))  # every row of a split may have been skipped
    return train, valid, {"state": "memory", "path": None, "seconds": round(time.perf_counter() - start, 3)}
