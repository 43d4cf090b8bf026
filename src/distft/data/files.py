"""Reading a local file's rows: JSON lines (.jsonl, .json), Parquet or CSV, one row at a time.

A file that is not what its name says is refused by its first bytes (`distft.textfiles`); a bad
line is a `DataError` naming `file:line` (a Parquet row: `file[row N]`; a CSV row: the line it
starts on).

CSV is read with the standard library's `csv` module, not pyarrow's reader (which reads Parquet):
every cell stays text, as the row formats want it (pyarrow would infer a prompt "42" to be a
number, an empty cell null), a row is read at a time, and each row's line is known. The header
row names the fields, so a CSV row is a record like a JSON line's, and the same formats are
detected in it: the flat ones (summary, prompt_completion, alpaca, text); a cell is never parsed
as JSON, so chat and sharegpt rows need JSON lines or Parquet.
"""

from __future__ import annotations

import csv
import json
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from distft.config import DataConfig
from distft.data.formats import Row, row_from_record
from distft.errors import DataError, one_line
from distft.text import plural
from distft.textfiles import HEAD_BYTES, JSON_ARRAY, JSON_LINES, PARQUET, looks_like, not_utf8


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


def iter_jsonl(path: Path, cfg: DataConfig, need_answer: bool = True) -> Iterator[Row]:
    with _open(path) as f:
        _check_jsonl_head(path, f.read(HEAD_BYTES))
    # Text mode (fast); a byte that is not UTF-8 stops it, and then the bytes tell where.
    with path.open(encoding="utf-8") as f:
        try:
            for line_no, line in enumerate(f, start=1):
                line = line.removeprefix("\ufeff") if line_no == 1 else line  # a byte-order mark
                if line.strip():
                    record = _json_line(line, f"{path}:{line_no}")
                    yield row_from_record(record, cfg, f"{path}:{line_no}", need_answer)
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


def _iter_parquet(path: Path, cfg: DataConfig, need_answer: bool = True) -> Iterator[Row]:
    for i, record in enumerate(_parquet_records(path)):
        yield row_from_record(record, cfg, f"{path}[row {i}]", need_answer)


# ---- CSV ---------------------------------------------------------------------------------------

CSV_FIELD_CHARS = 1 << 30  # the csv module's default, 131,072 characters, is short of a long meeting


def _check_csv_head(path: Path, head: bytes) -> None:
    """Refuse a .csv file whose first bytes are not text, or are JSON lines or Parquet."""
    looks = looks_like(head)
    if looks is PARQUET or looks is JSON_LINES:
        real = "parquet" if looks is PARQUET else "jsonl"
        raise DataError(
            f"{path} is not a CSV file: it looks like {looks.what}; rename it {path.stem}.{real}."
        )
    if not looks.text:
        advice = f"; {looks.advice}" if looks.advice else ""
        raise DataError(
            f"{path} is not UTF-8 text: it looks like {looks.what}{advice}. A .csv file holds rows of "
            "comma-separated fields in UTF-8, a header row naming the fields first."
        )


def _csv_header(reader: Any, path: Path) -> list[str] | None:
    """The field names of the first row that is not blank; None for a file without any."""
    header = next(reader, None)
    while header == []:
        header = next(reader, None)
    if header is not None:
        twice = sorted({name for name in header if header.count(name) > 1})
        if twice:
            raise DataError(f"{path}:{reader.line_num}: the header row names `{one_line(twice[0])}` twice.")
    return header


def iter_csv(path: Path, cfg: DataConfig, need_answer: bool = True) -> Iterator[Row]:
    """A CSV file's rows: the header row's names are the fields; a row spanning several lines (a
    quoted line break) is named by the line it starts on."""
    with _open(path) as f:
        _check_csv_head(path, f.read(HEAD_BYTES))
    csv.field_size_limit(max(csv.field_size_limit(), CSV_FIELD_CHARS))
    with path.open(encoding="utf-8-sig", newline="") as f:  # utf-8-sig: a byte-order mark dropped
        reader = csv.reader(f, strict=True)
        start = 1
        try:
            header = _csv_header(reader, path)
            start = reader.line_num + 1
            for cells in reader:
                where, start = f"{path}:{start}", reader.line_num + 1
                if cells and len(cells) != len(header):
                    raise DataError(
                        f"{where}: {plural(len(cells), 'field')}, and the header row names {len(header)} "
                        f"({', '.join(map(one_line, header))}). A field holding a comma, a quote or a line "
                        'break must be quoted ("...", a quote inside it doubled: "").'
                    )
                if cells:
                    yield row_from_record(dict(zip(header, cells, strict=True)), cfg, where, need_answer)
        except csv.Error as err:
            raise DataError(f"{path}:{start}: not valid CSV ({err}).") from None
        except UnicodeDecodeError:
            raise DataError(_first_bad_byte(path)) from None


READERS = {".parquet": _iter_parquet, ".csv": iter_csv}  # by suffix; any other: JSON lines


def iter_local(path: Path, cfg: DataConfig, need_answer: bool = True) -> Iterator[Row]:
    return READERS.get(path.suffix.lower(), iter_jsonl)(path, cfg, need_answer)


def iter_file(path: str | Path, cfg: DataConfig, need_answer: bool = True) -> Iterator[Row]:
    """The rows of a local .jsonl/.parquet/.csv file, unsplit, one at a time (`distft eval --data`,
    `distft infer --input`); with `need_answer=False` a meeting row may lack its summary ("")."""
    path = Path(path)
    check_is_file(path)
    return iter_local(path, cfg, need_answer)


def check_is_file(path: Path) -> None:
    """DataError unless `path` is a regular file, saying what it is instead."""
    if path.is_file():
        return
    if path.is_dir():
        raise DataError(f"Dataset file {path} is a directory; name a .jsonl, .parquet or .csv file in it.")
    if path.exists():  # a named pipe, a device, a socket: readable once, if at all
        mode = path.stat().st_mode
        kind = "a named pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise DataError(
            f"Dataset file {path} is {kind}, not a file: distft reads a dataset more than once (its "
            f"identity for the token cache, then its rows). Write it to a file first (cat {path} > rows.jsonl)."
        )
    raise DataError(f"Dataset file {path} does not exist.")
