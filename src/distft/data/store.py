"""Tokenised examples on disk: flat arrays, memory-mapped, read one example at a time.

One directory holds a dataset's examples end to end, and each split as a list of example numbers:

    tokens.bin      uint32  every example's token ids, end to end
    labelled.bin    uint8   1 where a position carries a label
    offsets.bin     int64   n + 1 of them: example k is tokens[offsets[k] : offsets[k + 1]]
    truncated.bin   int32   prompt tokens cut from example k to fit data.max_length
    <split>.idx     int64   the split's example numbers, in split order
    meta.json       counts, each split's summary, the cache key: written last

Labels are not stored: a label is either IGNORE or the next input token (`distft.data.chat`
shifts them), so one byte per token says which, 5 bytes per token in all instead of 8 (the writer
checks it). Opening maps the files and reads nothing else, so a rank's start-up does not grow with
the dataset; an example is read from the page cache when a batch asks for it.
"""

from __future__ import annotations

import json
import os
import statistics
from array import array
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np

from distft.data.chat import IGNORE, Example, TokenizedSplit, split_summary

STORE_VERSION = 1  # bump when the files above change
META = "meta.json"
_ARRAYS = {"tokens": np.uint32, "labelled": np.uint8, "offsets": np.int64, "truncated": np.int32}


@dataclass(eq=False)  # arrays: compare examples, not splits
class CachedSplit:
    """One split of a store, read by position like `TokenizedSplit` (which the loop cannot tell
    from it). The arrays are memory maps, shared by the splits of a store."""

    tokens: np.ndarray
    labelled: np.ndarray
    offsets: np.ndarray
    truncated: np.ndarray
    index: np.ndarray  # split position -> example number
    stats: dict  # `summary()`, computed when the store was written
    reads: int = 0  # examples handed out by position (the loop's batches)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Example:
        k = int(self.index[i])
        start, end = int(self.offsets[k]), int(self.offsets[k + 1])
        ids = self.tokens[start:end].astype(np.int64)
        labels = np.full(end - start, IGNORE, dtype=np.int64)
        labels[:-1] = np.where(self.labelled[start : end - 1] != 0, ids[1:], IGNORE)
        self.reads += 1
        return Example(ids.tolist(), labels.tolist(), int(self.truncated[k]))

    def label_count(self, i: int) -> int:
        """Positions of example `i` that carry a label (not counted as a read)."""
        k = int(self.index[i])
        start, end = int(self.offsets[k]), int(self.offsets[k + 1])
        return int(np.count_nonzero(self.labelled[start : end - 1]))  # as `__getitem__` reads them

    def summary(self) -> dict[str, float]:
        return dict(self.stats)


class StoreWriter:
    """Appends examples to a store's files; `close` writes the splits and `meta.json` last."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._tokens = (folder / "tokens.bin").open("wb")
        self._labelled = (folder / "labelled.bin").open("wb")
        self.lengths = array("q")
        self.truncated = array("i")

    def __len__(self) -> int:
        return len(self.lengths)

    def add(self, examples: list[Example]) -> None:
        if not examples:
            return
        ids = np.fromiter(chain.from_iterable(e.input_ids for e in examples), dtype=np.int64)
        labels = np.fromiter(chain.from_iterable(e.labels for e in examples), dtype=np.int64)
        labelled = labels != IGNORE
        last = np.cumsum([len(e.input_ids) for e in examples]) - 1
        following = np.append(ids[1:], 0)  # across an example's end only where it carries no label
        if labelled[last].any() or not np.array_equal(labels[labelled], following[labelled]):
            raise ValueError("a label must be IGNORE or the next input token, and IGNORE at the end")
        if ids.min() < 0 or ids.max() >= 2**32:
            raise ValueError("token ids must fit in uint32")
        ids.astype(np.uint32).tofile(self._tokens)
        labelled.astype(np.uint8).tofile(self._labelled)
        self.lengths.extend(len(e.input_ids) for e in examples)
        self.truncated.extend(e.truncated_tokens for e in examples)

    def close(self, splits: dict[str, np.ndarray], meta: dict, skipped: dict[str, list[str]]) -> None:
        """Write the per-example arrays, each split's example numbers, and `meta.json` last, all on
        disk (fsync) before the caller renames the directory into place. `skipped`: each split's
        rows skipped as too long, by origin (counted, and the first few named, in its summary)."""
        lengths = np.frombuffer(self.lengths, dtype=np.int64)
        truncated = np.frombuffer(self.truncated, dtype=np.int32)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        files = [self._tokens, self._labelled]
        for f in files:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        _write(self.folder / "offsets.bin", offsets)
        _write(self.folder / "truncated.bin", truncated)
        stats = {}
        for name, index in splits.items():
            _write(self.folder / f"{name}.idx", index.astype(np.int64))
            stats[name] = split_summary(lengths[index].tolist(), truncated[index].tolist(), skipped[name])
        meta = {
            "version": STORE_VERSION,
            "examples": len(lengths),
            "tokens": int(offsets[-1]),
            "splits": {name: len(index) for name, index in splits.items()},
            "summaries": stats,
            **meta,
        }
        with (self.folder / META).open("w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())


def _write(path: Path, values: np.ndarray) -> None:
    with path.open("wb") as f:
        values.tofile(f)
        f.flush()
        os.fsync(f.fileno())


def _map(path: Path, dtype: type, count: int) -> np.ndarray:
    """`path` as a read-only memory map of `count` values; a file of another size is refused."""
    size = path.stat().st_size if path.is_file() else -1
    if size != count * np.dtype(dtype).itemsize:
        raise ValueError(f"{path.name} holds {size} bytes, expected {count} values of {np.dtype(dtype)}")
    if count == 0:  # an empty file cannot be mapped
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def open_store(folder: Path) -> dict[str, CachedSplit]:
    """Every split of the store in `folder`, memory-mapped; ValueError if a file does not match
    `meta.json` (a store damaged after it was written: the writer never leaves one)."""
    meta = json.loads((folder / META).read_text(encoding="utf-8"))
    if meta.get("version") != STORE_VERSION:
        raise ValueError(f"store version {meta.get('version')}, this distft reads {STORE_VERSION}")
    n, n_tokens = meta["examples"], meta["tokens"]
    counts = {"tokens": n_tokens, "labelled": n_tokens, "offsets": n + 1, "truncated": n}
    arrays = {name: _map(folder / f"{name}.bin", dtype, counts[name]) for name, dtype in _ARRAYS.items()}
    return {
        name: CachedSplit(
            **arrays, index=_map(folder / f"{name}.idx", np.int64, rows), stats=meta["summaries"][name]
        )
        for name, rows in meta["splits"].items()
    }


def mean_label_tokens(split: CachedSplit | TokenizedSplit, sample: int = 512) -> float | None:
    """Mean labelled positions per example over up to `sample` examples spread evenly through
    `split` (in memory or memory-mapped); None for an empty split. What a pipeline's last stage
    runs lm_head on, per row (`distft.parallel.pipeline.cost`)."""
    if not len(split):
        return None
    picked = range(0, len(split), max(1, len(split) // sample))
    return statistics.mean(split.label_count(i) for i in picked)
