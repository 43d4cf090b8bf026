"""Reading rows: from the bundle, a local JSONL/Parquet/CSV file, a hub dataset, or memory.

Rows come from the synthetic meetings (`sample`, `sample-long`: `distft.data.sample`), a local
JSONL/Parquet/CSV file (`distft.data.files`), a hub dataset, several of these mixed by weight
(`data.sources`, `distft.data.mixture`), or a dataset handed to `distft.train.train(cfg,
dataset=...)` (a list of dicts, a `datasets.Dataset`, or a mapping of split name to either). Each
record is parsed by `distft.data.formats` (detected or set by `data.format`). A malformed row is a
`DataError` naming its file and line (or its index) before anything is launched.

Files and hub sets are read as streams (`row_source`): one row at a time, so the token cache
(`distft.data.cache`) can tokenise a set that does not fit in memory, and `validation_rows` gives
evaluation and inference their few rows without the rest. `load_rows` holds every row in memory:
training with `data.cache=false`, the bench's plain loop. All cut the splits the same way
(`held_out`), so a cached run trains on exactly the rows an in-memory one would.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distft.config import DataConfig
from distft.data.files import check_is_file, iter_jsonl, iter_local
from distft.data.formats import Row, row_from_record
from distft.data.mixture import data_name, mixture_picks, source_configs, source_weights, warn_starved
from distft.data.sample import SAMPLES, is_sample, sample_path
from distft.errors import DataError
from distft.hub import hub_offline
from distft.text import plural

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


@contextlib.contextmanager
def _offline_mode(offline: bool) -> Iterator[None]:
    """`datasets` and huggingface_hub read HF_HUB_OFFLINE once, at import: set it for one load."""
    if not offline:
        yield
        return
    import datasets.config
    import huggingface_hub.constants

    saved = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved


def _open_hub(dataset_id: str, split: str, cfg: DataConfig, offline: bool) -> Iterable[dict]:
    """A hub split: downloaded (memory-mapped by `datasets`), or a stream with `data.streaming`.
    `offline` (the hub unreachable, `distft.hub.hub_offline`): from the local cache only, at once,
    instead of retrying for half a minute."""
    import datasets

    try:
        with _offline_mode(offline):
            return datasets.load_dataset(
                dataset_id, split=split, streaming=cfg.streaming, revision=cfg.revision or None
            )
    except Exception as err:
        where = " The hub cannot be reached, and it is not in the local cache." if offline else ""
        raise DataError(
            f"Could not load dataset {dataset_id!r} split {split!r} ({str(err).splitlines()[0]}).{where} "
            "Offline, or for a gated set, download it elsewhere and pass the .jsonl/.parquet/.csv file with --data."
        ) from None


def _iter_hub(records: Iterable[dict], dataset_id: str, split: str, cfg: DataConfig) -> Iterator[Row]:
    return (row_from_record(r, cfg, f"{dataset_id}[{split}][{i}]") for i, r in enumerate(records))


# ---- where rows come from ---------------------------------------------------------------------


@dataclass
class RowSource:
    """A dataset's rows, read lazily. `parts` maps "train" and "validation" to a function that
    opens a fresh stream of that split's rows, or "all" to the one stream a validation split is
    cut from (`held_out`). `too_few` is the refusal of an "all" stream of fewer than 2 rows."""

    name: str
    parts: dict[str, Callable[[], Iterator[Row]]]
    too_few: str = ""


def is_local(cfg: DataConfig) -> bool:
    return is_local_file(cfg.source)


def is_local_file(name: str) -> bool:
    """Whether `name` is a file of rows by its suffix, in any case (`MEETINGS.CSV` too)."""
    return name.lower().endswith(LOCAL_SUFFIXES)


MEMORY = "memory:"  # a run trained on `train(cfg, dataset=...)`: data.source = "memory:N rows:HASH"


def memory_source(dataset: Any) -> str:
    """What an in-memory dataset is called in the run's config, header and lineage: its row count
    and a content hash (SHA-256 of its records as sorted JSON), e.g. `memory:12 rows:3f2a9c01b7e4`."""
    splits = dataset if isinstance(dataset, Mapping) else {"": dataset}
    digest, n = hashlib.sha256(), 0
    for name in sorted(splits, key=str):
        for record in splits[name]:
            digest.update(json.dumps([str(name), record], sort_keys=True, default=str).encode())
            n += 1
    return f"{MEMORY}{plural(n, 'row')}:{digest.hexdigest()[:12]}"


def row_source(cfg: DataConfig) -> RowSource:
    """Where `cfg.source`'s rows come from. A hub set is opened here (a download, unless
    `data.streaming`), to learn whether it has a validation split. A mixture (`data.sources`) has
    one per source (`distft.data.mixture.source_configs`)."""
    if cfg.sources:
        raise ValueError("row_source takes one source: call it on each of source_configs(cfg)")
    if cfg.source.startswith(MEMORY):
        raise DataError(
            f"This run trained on rows handed to train() from Python ({cfg.source}), which distft cannot "
            "read back: say which rows to use, `distft infer --input FILE` (a transcript, or a "
            ".jsonl/.parquet/.csv of rows) or `distft eval --data FILE`."
        )
    if is_sample(cfg.source):  # a generated set is written on its first read
        return RowSource(
            cfg.source,
            {
                s: (lambda s=s: iter_jsonl(sample_path(s, cfg.source), cfg))
                for s in SAMPLES[cfg.source].splits
            },
        )
    if is_local(cfg):
        path = Path(cfg.source)
        check_is_file(path)
        too_few = (
            f"Dataset file {path} has {{n}} row(s); training needs at least 2 (one is held out "
            "for validation), each a row of one of the formats docs/data.md lists."
        )
        return RowSource(str(path), {"all": lambda: iter_local(path, cfg)}, too_few)
    if Path(cfg.source).exists():
        hint = (
            " (tab-separated: convert it first, e.g. pandas.read_csv(path, sep='\\t').to_csv('rows.csv', index=False))"
            if cfg.source.lower().endswith(".tsv")
            else ""
        )
        raise DataError(
            f"{cfg.source}: a local dataset must be a .jsonl file (.json: also JSON lines), a .parquet or a .csv "
            f"file{hint}."
        )
    offline = hub_offline()  # probed once per set
    train = _open_hub(cfg.source, cfg.train_split, cfg, offline)
    parts = {"train": lambda: _iter_hub(train, cfg.source, cfg.train_split, cfg)}
    try:
        valid = _open_hub(cfg.source, cfg.validation_split, cfg, offline)
        parts["validation"] = lambda: _iter_hub(valid, cfg.source, cfg.validation_split, cfg)
    except DataError:  # no validation split: one is cut from train
        parts = {"all": parts["train"]}
    return RowSource(cfg.source, parts)


def held_out(n: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) positions of `n` rows: a seeded permutation, `fraction` held out."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = max(1, round(n * fraction))
    return order[n_val:], order[:n_val]


def check_splits(train: int, validation: int, name: str) -> None:
    if not train:
        raise DataError(f"Dataset {name} has no training rows.")
    if not validation:
        raise DataError(f"Dataset {name} has no validation rows.")


def validation_rows(cfg: DataConfig, seed: int = 0, limit: int = 1) -> list[Row]:
    """The first `limit` rows of the validation split, the same rows as `load_rows(cfg,
    seed)["validation"][:limit]`, read as a stream that holds only those: `distft eval` and
    `distft infer` on a set of millions. A source without a validation split is read twice, once
    to count its rows (its split is a seeded permutation of them) and once to pick them. A
    mixture's validation split is its sources' in turn."""
    if cfg.sources:
        rows = []
        for sub in source_configs(cfg):
            rows += validation_rows(sub, seed, limit - len(rows)) if len(rows) < limit else []
        return rows
    source = row_source(cfg)
    if "all" not in source.parts:
        rows = list(itertools.islice(source.parts["validation"](), limit))
        if not rows:
            raise DataError(f"Dataset {cfg.source} has no validation rows.")
        return rows
    read = source.parts["all"]
    n = sum(1 for _ in read())
    if source.too_few and n < 2:
        raise DataError(source.too_few.format(n=n))
    _, valid = held_out(n, cfg.validation_fraction, seed)
    slot = {position: k for k, position in enumerate(valid[:limit].tolist())}
    rows: list[Row | None] = [None] * len(slot)
    for i, row in enumerate(read()):
        if i in slot:
            rows[slot.pop(i)] = row
            if not slot:
                break
    return rows  # type: ignore[return-value]  # every slot filled: the positions are below n


# ---- every row in memory ---------------------------------------------------------------------


def _split_off(rows: list[Row], fraction: float, seed: int) -> dict[str, list[Row]]:
    train, valid = held_out(len(rows), fraction, seed)
    return {"validation": [rows[i] for i in valid.tolist()], "train": [rows[i] for i in train.tolist()]}


def _read_memory(records: Iterable[Any], cfg: DataConfig, name: str) -> list[Row]:
    return [row_from_record(r, cfg, f"{name}[{i}]") for i, r in enumerate(records)]


def _memory_splits(dataset: Any, cfg: DataConfig, seed: int) -> dict[str, list[Row]]:
    """Rows of an in-memory dataset: one collection (validation split off), or named splits."""
    if isinstance(dataset, Mapping):
        if "train" not in dataset:
            raise DataError(
                f"The dataset's splits are {', '.join(map(str, dataset))}; it needs a `train` split."
            )
        train = _read_memory(dataset["train"], cfg, "dataset[train]")
        if cfg.validation_split in dataset:
            valid = _read_memory(dataset[cfg.validation_split], cfg, f"dataset[{cfg.validation_split}]")
            return {"train": train, "validation": valid}
        rows = train
    else:
        if isinstance(dataset, str | bytes) or not isinstance(dataset, Iterable):
            raise DataError(
                f"dataset= takes a list of dicts, a datasets.Dataset or a dict of splits, got {type(dataset).__name__}."
            )
        rows = _read_memory(dataset, cfg, "dataset")
    if len(rows) < 2:
        raise DataError(
            f"The dataset has {plural(len(rows), 'row')}; training needs at least 2 (one is held out)."
        )
    return _split_off(rows, cfg.validation_fraction, seed)


def load_rows(cfg: DataConfig, seed: int = 0, dataset: Any = None) -> dict[str, list[Row]]:
    """{"train": rows, "validation": rows} from `dataset` if given (in memory), else `cfg.source`."""
    if dataset is not None:
        if cfg.sources:
            raise DataError(
                "Rows handed to train(dataset=...) and data.sources both name the rows: keep one."
            )
        splits = _memory_splits(dataset, cfg, seed)
        name = "(in memory)"
    elif cfg.sources:  # each source split on its own, then mixed (`distft.data.mixture`)
        parts = [load_rows(sub, seed) for sub in source_configs(cfg)]
        sizes = [len(p["train"]) for p in parts]
        warn_starved(cfg, sizes)
        source, position = mixture_picks(sizes, source_weights(cfg), seed)
        train = [parts[i]["train"][j] for i, j in zip(source.tolist(), position.tolist(), strict=True)]
        splits = {"train": train, "validation": [row for p in parts for row in p["validation"]]}
        name = data_name(cfg)
    else:
        source = row_source(cfg)
        splits = {part: list(read()) for part, read in source.parts.items()}
        if "all" in splits:
            if source.too_few and len(splits["all"]) < 2:
                raise DataError(source.too_few.format(n=len(splits["all"])))
            splits = _split_off(splits.pop("all"), cfg.validation_fraction, seed)
        name = cfg.source
    if cfg.max_rows:
        splits["train"] = splits["train"][: cfg.max_rows]
    check_splits(len(splits["train"]), len(splits["validation"]), name)
    return splits
