"""Property tests: whatever bytes or JSON a dataset file holds, reading it ends in rows or in a
`DataError` (one paragraph, exit code 2 from the CLI), never in another exception. Settings (60
examples each, no deadline; derandomized under CI): the profiles in tests/conftest.py."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from distft.config import DataConfig
from distft.config.choices import DATA_FORMATS
from distft.data import iter_file, row_from_record
from distft.errors import DataError
from distft.infer.commands import read_input
from distft.textfiles import decode_utf8

# Field names every format looks for, so random rows reach the parsers, not only the detection.
FIELDS = [
    "transcript", "summary", "dialogue", "input", "output", "instruction", "prompt", "completion",
    "messages", "role", "content", "meeting_transcripts", "general_query_list", "query", "answer",
    "speaker", "other",
]  # fmt: skip
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
JSON = st.recursive(
    SCALARS | st.sampled_from(["system", "user", "assistant", "Summarize the whole meeting."]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(FIELDS), inner, max_size=5),
    max_leaves=20,
)


def objects(*keys: str) -> st.SearchStrategy:
    """Lists of objects with (some of) `keys`, or any JSON: the nested shapes chat and QMSum rows take."""
    items = st.dictionaries(st.sampled_from(keys), JSON, max_size=len(keys)) | JSON
    return st.lists(items, max_size=3) | st.text(max_size=20) | JSON


ROWS = (
    st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=4), JSON, max_size=6)
    | st.fixed_dictionaries({"messages": objects("role", "content")})
    | st.fixed_dictionaries(
        {
            "meeting_transcripts": objects("speaker", "content"),
            "general_query_list": objects("query", "answer"),
        }
    )
)
CONFIGS = st.just(DataConfig()) | st.builds(  # the default (auto: every format detected) half the time
    DataConfig,
    format=st.sampled_from(DATA_FORMATS),
    transcript_field=st.sampled_from(["", "dialogue", "input"]),
    summary_field=st.sampled_from(["", "output"]),
)


def read_all(path, cfg=None, need_answer=True):
    """Every row of `path`, or the DataError reading it stops at; any other exception fails the test."""
    try:
        return list(iter_file(path, cfg or DataConfig(), need_answer))
    except DataError as err:
        assert "\n" not in str(err).strip(), err  # one paragraph
        return err


def parquet_bytes() -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist([{"transcript": "A: hi", "summary": "Hi."}] * 3), sink)
    return sink.getvalue().to_pybytes()


PARQUET = parquet_bytes()
DAMAGED = st.builds(  # a real Parquet file cut short, or with one byte changed
    lambda cut, at, byte: (
        PARQUET[:cut] if cut < len(PARQUET) else PARQUET[:at] + bytes([byte]) + PARQUET[at + 1 :]
    ),
    st.integers(0, 2 * len(PARQUET)),
    st.integers(0, len(PARQUET) - 1),
    st.integers(0, 255),
)
BYTES = st.binary(max_size=300) | st.binary(max_size=100).map(lambda b: b"PAR1" + b + b"PAR1") | DAMAGED


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
@given(data=BYTES)
def test_any_bytes_read_or_refuse(tmp_path, suffix, data):
    path = tmp_path / f"rows{suffix}"
    path.write_bytes(data)
    read_all(path)


@given(rows=st.lists(JSON, max_size=4), cfg=CONFIGS, need_answer=st.booleans())
def test_any_json_lines_read_or_refuse(tmp_path, rows, cfg, need_answer):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    result = read_all(path, cfg, need_answer)
    if not isinstance(result, DataError):
        assert len(result) == len(rows)


@given(record=ROWS | JSON, cfg=CONFIGS, need_answer=st.booleans())
def test_any_record_is_a_row_or_a_data_error(record, cfg, need_answer):
    try:
        row_from_record(record, cfg, "rows.jsonl:1", need_answer)
    except DataError as err:
        assert str(err).startswith("rows.jsonl:1: "), err  # says where


@given(rows=st.lists(ROWS, min_size=1, max_size=4), need_answer=st.booleans())
def test_any_parquet_rows_read_or_refuse(tmp_path, rows, need_answer):
    path = tmp_path / "rows.parquet"
    try:
        pq.write_table(pa.Table.from_pylist(rows), path)
    except (pa.ArrowException, OverflowError):  # rows pyarrow cannot put in one Parquet table
        assume(False)
    read_all(path, need_answer=need_answer)


@given(data=st.binary(max_size=300) | st.text(max_size=100).map(lambda t: t.encode("utf-16")))
def test_any_input_text_decodes_or_refuses(tmp_path, data):
    path = tmp_path / "meeting.txt"
    path.write_bytes(data)
    for read in (lambda: read_input(str(path)), lambda: decode_utf8(data, "x.txt", DataError)):
        try:
            assert isinstance(read(), str)
        except DataError as err:
            assert "UTF-8" in str(err), err
