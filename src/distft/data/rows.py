"""Reading rows: from the bundle, a local JSONL/Parquet file, a hub dataset, or memory.

Rows come from the bundled sample meetings, a local JSONL/Parquet file, a hub dataset, or a
dataset handed to `distft.train.train(cfg, dataset=...)` (a list of dicts, a `datasets.Dataset`,
or a mapping of split name to either). Each record is parsed by `distft.data.formats` (summary,
chat, prompt/completion or alpaca, detected or set by `data.format`). A malformed row is a
`DataError` naming its file and line (or its index) before anything is launched.

Files and hub sets are read as streams (`row_source`): one row at a time, so the token cache
(`distft.data.cache`) can tokenise a set that does not fit in memory, and `validation_rows` gives
evaluation and inference their few rows without the rest. `load_rows` holds every row in memory:
training with `data.cache=false`, the bench's plain loop. All cut the splits the same way
(`held_out`), so a cached run trains on exactly the rows an in-memory one would.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from distft.config import DataConfig
from distft.data.formats import Row, row_from_record
from distft.data.sample import sample_path
from distft.errors import DataError
from distft.text import plural
from distft.textfiles import HEAD_BYTES, JSON_ARRAY, JSON_LINES, PARQUET, looks_like, not_utf8

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


def _open(path: Path) -> BinaryIO:
    try:
        return path.open("rb")
    except OSError as err:
        raise DataError(f"Dataset file {path} cannot be read ({err.strerror or err}).") from None


def _check_jsonl_head(path: Path, head: bytes) -> None:
    """Refuse a .jsonl/.json file whose first bytes are not JSON lines: naming what they look like."""
    looks = looks_like(head)
    if looks is PARQUET:
        raise DataError(f"{path} is a Parquet file, not JSON lines: rename it {path.stem}.parquet.")
    if not looks.text:
        advice = f"; {looks.advice}" if looks.advice else ""
        raise DataError(
            f"{path} is not UTF-8 text: it looks like {looks.what}{advice}. A {path.suffix} file holds "
            "JSON lines: one JSON object per line, in UTF-8."
        )
    if looks is JSON_ARRAY:
        raise DataError(
            f"{path} holds a JSON array; distft reads JSON lines, one object per line: convert it, e.g. "
            f"`jq -c '.[]' {path.name} > rows.jsonl`."
        )


def _json_line(line: str, where: str) -> Any:
    """One line's JSON value; a DataError naming `where` (file:line) if it is not JSON."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not valid JSON ({err.msg} at column {err.colno}).") from None
    except (ValueError, RecursionError) as err:  # a number of 5000 digits; nesting deeper than the stack
        why = "nested too deeply" if isinstance(err, RecursionError) else str(err).split(":")[0]
        raise DataError(f"{where}: a JSON value distft cannot read ({why}).") from None


def _first_bad_byte(path: Path) -> str:
    """The refusal of a file that does not decode as UTF-8, naming the line of its first bad byte."""
    with _open(path) as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as err:
                return f"{not_utf8(raw, err.start, f'{path}:{line_no}')}; re-save the file as UTF-8."
    return f"{path} is not UTF-8 text; re-save it as UTF-8."  # a character cut by the end of the file


def _iter_jsonl(path: Path, cfg: DataConfig, need_summary: bool = True) -> Iterator[Row]:
    with _open(path) as f:
        _check_jsonl_head(path, f.read(HEAD_BYTES))
    # Text mode (fast); a byte that is not UTF-8 stops it, and then the bytes tell where.
    with path.open(encoding="utf-8") as f:
        try:
            for line_no, line in enumerate(f, start=1):
                line = line.removeprefix("\ufeff") if line_no == 1 else line  # a byte-order mark
                if line.strip():
                    record = _json_line(line, f"{path}:{line_no}")
                    yield row_from_record(record, cfg, f"{path}:{line_no}", need_summary)
        except UnicodeDecodeError:
            raise DataError(_first_bad_byte(path)) from None


def _parquet_records(path: Path) -> Iterator[dict]:
    """A Parquet file's records, one batch in memory at a time; a DataError if it is not one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with _open(path) as f:
        looks = looks_like(f.read(HEAD_BYTES))
    if looks is JSON_LINES:
        raise DataError(
            f"{path} is not a Parquet file: it starts like JSON lines; rename it {path.stem}.jsonl."
        )
    if looks is not PARQUET:
        raise DataError(f"{path} is not a Parquet file: it looks like {looks.what}.")
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            yield from batch.to_pylist()
    except (pa.ArrowException, OSError, ValueError) as err:
        raise DataError(
            f"{path} is not a readable Parquet file ({str(err).splitlines()[0].rstrip('.')}): it may be cut short "
            "or damaged; write it again."
        ) from None


def _iter_parquet(path: Path, cfg: DataConfig, need_summary: bool = True) -> Iterator[Row]:
    for i, record in enumerate(_parquet_records(path)):
        yield row_from_record(record, cfg, f"{path}[row {i}]", need_summary)


def _iter_file(path: Path, cfg: DataConfig, need_summary: bool = True) -> Iterator[Row]:
    return (_iter_parquet if path.suffix == ".parquet" else _iter_jsonl)(path, cfg, need_summary)


def iter_file(path: str | Path, cfg: DataConfig, need_summary: bool = True) -> Iterator[Row]:
    """The rows of a local .jsonl/.parquet file, unsplit, one at a time (`distft eval --data`,
    `distft infer --input`); with `need_summary=False` a meeting row may lack its summary ("")."""
    path = Path(path)
    _check_is_file(path)
    return _iter_file(path, cfg, need_summary)


def _check_is_file(path: Path) -> None:
    if path.is_dir():
        raise DataError(f"Dataset file {path} is a directory; name a .jsonl or .parquet file in it.")
    if not path.is_file():
        raise DataError(f"Dataset file {path} does not exist.")


def _open_hub(dataset_id: str, split: str, cfg: DataConfig) -> Iterable[dict]:
    """A hub split: downloaded (memory-mapped by `datasets`), or a stream with `data.streaming`."""
    import datasets

    try:
        return datasets.load_dataset(
            dataset_id, split=split, streaming=cfg.streaming, revision=cfg.revision or None
        )
    except Exception as err:
        raise DataError(
            f"Could not load dataset {dataset_id!r} split {split!r} ({str(err).splitlines()[0]}). "
            "Offline, or for a gated set, download it elsewhere and pass the .jsonl/.parquet file with --data."
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
    return cfg.source.endswith(LOCAL_SUFFIXES)


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
    `data.streaming`), to learn whether it has a validation split."""
    if cfg.source.startswith(MEMORY):
        raise DataError(
            f"This run trained on rows handed to train() from Python ({cfg.source}), which distft cannot "
            "read back: say which rows to use, `distft infer --input FILE` (a transcript, or a "
            ".jsonl/.parquet of rows) or `distft eval --data FILE`."
        )
    if cfg.source == "sample":
        return RowSource(
            "sample", {s: (lambda s=s: _iter_jsonl(sample_path(s), cfg)) for s in ("train", "validation")}
        )
    if is_local(cfg):
        path = Path(cfg.source)
        _check_is_file(path)
        too_few = (
            f"Dataset file {path} has {{n}} row(s); training needs at least 2 (one is held out "
            "for validation), each a JSON object with a transcript and a summary."
        )
        return RowSource(str(path), {"all": lambda: _iter_file(path, cfg)}, too_few)
    if Path(cfg.source).exists():
        csv = (
            " (CSV: convert it first, e.g. with pandas' to_json(lines=True))"
            if cfg.source.lower().endswith((".csv", ".tsv"))
            else ""
        )
        raise DataError(
            f"{cfg.source}: a local dataset must be a .jsonl file (.json: also JSON lines) or a .parquet file{csv}."
        )
    train = _open_hub(cfg.source, cfg.train_split, cfg)
    parts = {"train": lambda: _iter_hub(train, cfg.source, cfg.train_split, cfg)}
    try:
        valid = _open_hub(cfg.source, cfg.validation_split, cfg)
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
    to count its rows (its split is a seeded permutation of them) and once to pick them."""
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
        splits = _memory_splits(dataset, cfg, seed)
        name = "(in memory)"
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
