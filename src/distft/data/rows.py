"""Reading meeting transcripts: rows of (transcript, summary) from a file, a hub dataset or the bundle.

Rows come from the bundled sample meetings, a local JSONL/Parquet file, or a hub dataset; the
known AMI schemas are recognised (knkarthick/AMI `{dialogue, summary}`, QMSum
`{meeting_transcripts, general_query_list}`, qmsum-cleaned `{input, output}`, ours
`{transcript, summary}`), other field names are configurable. A malformed row is a `DataError`
naming its file and line before anything is launched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distft.config import DataConfig
from distft.data.sample import sample_path
from distft.errors import DataError


@dataclass(frozen=True)
class MeetingRow:
    transcript: str
    summary: str
    origin: str  # "file.jsonl:12" or "dataset[split][7]": where to look when something is wrong


# (transcript field, summary field) of the schemas recognised without configuration.
KNOWN_SCHEMAS: list[tuple[str, str]] = [
    ("transcript", "summary"),  # distft sample meetings
    ("dialogue", "summary"),  # knkarthick/AMI
    ("input", "output"),  # pszemraj/qmsum-cleaned
    ("meeting_transcripts", "general_query_list"),  # QMSum raw
]


def _text_of(value: Any, field: str) -> str:
    """Flatten QMSum's structured fields; plain strings pass through."""
    if isinstance(value, str):
        return value
    if field == "meeting_transcripts" and isinstance(value, list):
        return "\n".join(f"{turn['speaker']}: {turn['content']}" for turn in value)
    if field == "general_query_list" and isinstance(value, list):
        # The whole-meeting summary is the general query "Summarize the whole meeting."
        for query in value:
            if "whole meeting" in query.get("query", "").lower():
                return query["answer"]
        return value[0]["answer"] if value else ""
    raise TypeError(f"unsupported value of type {type(value).__name__}")


def row_from_record(
    record: dict[str, Any], cfg: DataConfig, origin: str, need_summary: bool = True
) -> MeetingRow:
    if not isinstance(record, dict):
        raise DataError(f"{origin}: expected a JSON object, got {type(record).__name__}.")
    if cfg.transcript_field or cfg.summary_field:
        fields = (cfg.transcript_field or "transcript", cfg.summary_field or "summary")
    else:
        fields = next((s for s in KNOWN_SCHEMAS if s[0] in record and s[1] in record), None)
        # A known schema with one of its two fields present: report the other one as missing.
        fields = fields or next((s for s in KNOWN_SCHEMAS if s[0] in record or s[1] in record), None)
        if fields is None:
            known = "; ".join(f"{{{t}, {s}}}" for t, s in KNOWN_SCHEMAS)
            raise DataError(
                f"{origin}: no transcript/summary fields found (row has: {', '.join(sorted(record))}). "
                f"Known schemas: {known}. Name yours with data.transcript_field=... data.summary_field=..."
            )
    texts = []
    for field in fields:
        if field not in record and not need_summary and field == fields[1]:
            texts.append("")  # inference: a row to summarise need not carry a summary
            continue
        if field not in record:
            raise DataError(f"{origin}: missing field `{field}` (row has: {', '.join(sorted(record))}).")
        try:
            text = _text_of(record[field], field).strip()
        except (TypeError, KeyError) as err:
            raise DataError(f"{origin}: field `{field}` is not text ({err}).") from None
        if not text:
            raise DataError(f"{origin}: field `{field}` is empty.")
        texts.append(text)
    return MeetingRow(texts[0], texts[1], origin)


def _read_jsonl(path: Path, cfg: DataConfig, need_summary: bool = True) -> list[MeetingRow]:
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


def _read_parquet(path: Path, cfg: DataConfig, need_summary: bool = True) -> list[MeetingRow]:
    import pyarrow.parquet as pq

    table = pq.read_table(path).to_pylist()
    return [row_from_record(r, cfg, f"{path}[row {i}]", need_summary) for i, r in enumerate(table)]


def read_file(path: str | Path, cfg: DataConfig, need_summary: bool = True) -> list[MeetingRow]:
    """Every row of a local .jsonl/.parquet file, unsplit (`distft eval --data`, `distft infer
    --input`); with `need_summary=False` a row may lack its summary (it is then "")."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"Dataset file {path} does not exist.")
    reader = _read_parquet if path.suffix == ".parquet" else _read_jsonl
    return reader(path, cfg, need_summary)


def _read_hub(dataset_id: str, split: str, cfg: DataConfig) -> list[MeetingRow]:
    import datasets

    try:
        ds = datasets.load_dataset(dataset_id, split=split)
    except Exception as err:
        raise DataError(
            f"Could not load dataset {dataset_id!r} split {split!r} ({str(err).splitlines()[0]}). "
            "Offline, or for a gated set, download it elsewhere and pass the .jsonl/.parquet file with --data."
        ) from None
    return [row_from_record(r, cfg, f"{dataset_id}[{split}][{i}]") for i, r in enumerate(ds)]


def _split_off(rows: list[MeetingRow], fraction: float, seed: int) -> dict[str, list[MeetingRow]]:
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = max(1, round(len(rows) * fraction))
    return {"validation": [rows[i] for i in order[:n_val]], "train": [rows[i] for i in order[n_val:]]}


def load_rows(cfg: DataConfig, seed: int = 0) -> dict[str, list[MeetingRow]]:
    """{"train": rows, "validation": rows} from `cfg.source`."""
    if cfg.source == "sample":
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
        raise DataError(f"Dataset {cfg.source} has no training rows.")
    if not splits["validation"]:
        raise DataError(f"Dataset {cfg.source} has no validation rows.")
    return splits
