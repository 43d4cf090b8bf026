"""Reading rows: from the bundle, a local JSONL/Parquet file, a hub dataset, or memory.

Rows come from the bundled sample meetings, a local JSONL/Parquet file, a hub dataset, or a
dataset handed to `distft.train.train(cfg, dataset=...)` (a list of dicts, a `datasets.Dataset`,
or a mapping of split name to either). Each record is parsed by `distft.data.formats` (summary,
chat, prompt/completion or alpaca, detected or set by `data.format`). A malformed row is a
`DataError` naming its file and line (or its index) before anything is launched.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from distft.config import DataConfig
from distft.data.formats import Row, row_from_record
from distft.data.sample import sample_path
from distft.errors import DataError


def _read_jsonl(path: Path, cfg: DataConfig, need_summary: bool = True) -> list[Row]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{path}:{line_no}: not valid JSON ({err.msg} at column {err.colno})."
                ) from None
            rows.append(row_from_record(record, cfg, f"{path}:{line_no}", need_summary))
    return rows


def _read_parquet(path: Path, cfg: DataConfig, need_summary: bool = True) -> list[Row]:
    import pyarrow.parquet as pq

    table = pq.read_table(path).to_pylist()
    return [row_from_record(r, cfg, f"{path}[row {i}]", need_summary) for i, r in enumerate(table)]


def read_file(path: str | Path, cfg: DataConfig, need_summary: bool = True) -> list[Row]:
    """Every row of a local .jsonl/.parquet file, unsplit (`distft eval --data`, `distft infer
    --input`); with `need_summary=False` a meeting row may lack its summary (it is then "")."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"Dataset file {path} does not exist.")
    reader = _read_parquet if path.suffix == ".parquet" else _read_jsonl
    return reader(path, cfg, need_summary)


def _read_hub(dataset_id: str, split: str, cfg: DataConfig) -> list[Row]:
    import datasets

    try:
        ds = datasets.load_dataset(dataset_id, split=split)
    except Exception as err:
        raise DataError(
            f"Could not load dataset {dataset_id!r} split {split!r} ({str(err).splitlines()[0]}). "
            "Offline, or for a gated set, download it elsewhere and pass the .jsonl/.parquet file with --data."
        ) from None
    return [row_from_record(r, cfg, f"{dataset_id}[{split}][{i}]") for i, r in enumerate(ds)]


def _split_off(rows: list[Row], fraction: float, seed: int) -> dict[str, list[Row]]:
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = max(1, round(len(rows) * fraction))
    return {"validation": [rows[i] for i in order[:n_val]], "train": [rows[i] for i in order[n_val:]]}


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
        raise DataError(f"The dataset has {len(rows)} row(s); training needs at least 2 (one is held out).")
    return _split_off(rows, cfg.validation_fraction, seed)


def load_rows(cfg: DataConfig, seed: int = 0, dataset: Any = None) -> dict[str, list[Row]]:
    """{"train": rows, "validation": rows} from `dataset` if given (in memory), else `cfg.source`."""
    if dataset is not None:
        splits = _memory_splits(dataset, cfg, seed)
    elif cfg.source == "sample":
        splits = {name: _read_jsonl(sample_path(name), cfg) for name in ("train", "validation")}
    elif cfg.source.endswith((".jsonl", ".json", ".parquet")):
        path = Path(cfg.source)
        if not path.is_file():
            raise DataError(f"Dataset file {path} does not exist.")
        reader = _read_parquet if path.suffix == ".parquet" else _read_jsonl
        rows = reader(path, cfg)
        if len(rows) < 2:
            raise DataError(
                f"Dataset file {path} has {len(rows)} row(s); training needs at least 2 (one is held out "
                "for validation), each a JSON object with a transcript and a summary."
            )
        splits = _split_off(rows, cfg.validation_fraction, seed)
    elif Path(cfg.source).exists():
        raise DataError(f"{cfg.source}: a local dataset must be a .jsonl or .parquet file.")
    else:
        train = _read_hub(cfg.source, cfg.train_split, cfg)
        try:
            splits = {"train": train, "validation": _read_hub(cfg.source, cfg.validation_split, cfg)}
        except DataError:
            splits = _split_off(train, cfg.validation_fraction, seed)
    if cfg.max_rows:
        splits["train"] = splits["train"][: cfg.max_rows]
    if not splits["train"]:
        raise DataError(f"Dataset {_name(cfg, dataset)} has no training rows.")
    if not splits["validation"]:
        raise DataError(f"Dataset {_name(cfg, dataset)} has no validation rows.")
    return splits


def _name(cfg: DataConfig, dataset: Any) -> str:
    return "(in memory)" if dataset is not None else cfg.source
