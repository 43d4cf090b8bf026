"""A dataset file that is not what its name says (binary, UTF-16, Parquet named .jsonl, JSON lines
named .parquet, a JSON array, an archive) is refused with one DataError naming the file and what
it looks like; a text file for `distft infer --input` likewise."""

import gzip
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from distft.config import DataConfig
from distft.data import iter_file, load_rows, row_from_record
from distft.errors import DataError
from distft.infer.commands import read_input

ROW = {"transcript": "A: hello there\nB: hi", "summary": "They greet."}
LINES = "".join(json.dumps({**ROW, "summary": f"S{i}"}) + "\n" for i in range(3))


def parquet(rows=(ROW, ROW, ROW)) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(list(rows)), sink)
    return sink.getvalue().to_pybytes()


# (file name, its bytes, what the message says)
BAD_FILES = [
    ("utf16.jsonl", LINES.encode("utf-16"), "is not UTF-8 text: it looks like UTF-16 text (a little-endian"),
    ("utf16be.jsonl", LINES.encode("utf-16-be"), "UTF-16 text (big-endian, no byte-order mark); re-save it"),
    ("binary.jsonl", bytes(range(256)) * 4, "is not UTF-8 text: it looks like binary data (a NUL byte"),
    (
        "latin1.jsonl",
        LINES.replace("hi", "h\u00e9").encode("latin-1"),
        ":1: not UTF-8 text (byte 0xE9 at column",
    ),
    (
        "later.jsonl",
        LINES.encode() + b'{"x": "caf\xe9"}\n',
        "later.jsonl:4: not UTF-8 text (byte 0xE9 at column",
    ),
    ("table.jsonl", parquet(), "is a Parquet file, not JSON lines: rename it table.parquet"),
    ("rows.json", json.dumps([ROW, ROW]).encode(), "holds a JSON array; distft reads JSON lines"),
    ("pretty.json", json.dumps([ROW, ROW], indent=2).encode(), "holds a JSON array"),
    ("zipped.jsonl", gzip.compress(LINES.encode()), "it looks like a gzip archive; decompress it first"),
    (
        "lines.parquet",
        LINES.encode(),
        "is not a Parquet file: it starts like JSON lines; rename it lines.jsonl.",
    ),
    ("utf16.parquet", LINES.encode("utf-16"), "is not a Parquet file: it looks like UTF-16 text"),
    ("empty.parquet", b"", "is not a Parquet file: it looks like an empty file."),
    ("cut.parquet", parquet()[:-30], "is not a readable Parquet file ("),
    ("deep.jsonl", b"[" * 100_000 + b"\n", "holds a JSON array"),
    (
        "deep2.jsonl",
        b'{"a": ' + b"[" * 100_000 + b"\n",
        "deep2.jsonl:1: a JSON value distft cannot read (nested",
    ),
    (
        "digits.jsonl",
        b'{"a": ' + b"1" * 5000 + b"}\n",
        "digits.jsonl:1: a JSON value distft cannot read (Exceeds",
    ),
]


@pytest.mark.parametrize(("name", "data", "phrase"), BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_a_file_that_is_not_what_its_name_says_is_refused(tmp_path, name, data, phrase):
    path = tmp_path / name
    path.write_bytes(data)
    for read in (
        lambda: load_rows(DataConfig(source=str(path))),
        lambda: list(iter_file(path, DataConfig())),
    ):
        with pytest.raises(DataError) as err:
            read()
        message = str(err.value)
        assert phrase in message and str(path) in message, message
        assert "\n" not in message


@pytest.mark.parametrize(
    "data",
    [
        b"\xef\xbb\xbf" + LINES.encode(),  # a byte-order mark (Windows editors write one)
        LINES.replace("\n", "\r\n").encode(),  # Windows line ends
        ("\n\n" + LINES + "\n").encode(),  # blank lines
        b"\xef\xbb\xbf\n" + LINES.encode(),  # a byte-order mark on a blank first line
    ],
)
def test_utf8_variants_read(tmp_path, data):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(data)
    assert [r.summary for r in iter_file(path, DataConfig())] == ["S0", "S1", "S2"]


def test_an_unreadable_file_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "rows.jsonl"
    path.write_text(LINES)
    path.chmod(0)
    if os.access(path, os.R_OK):  # root reads anything: the refusal the kernel would give, given
        real_open = Path.open

        def denied(self, *args, **kwargs):
            if self == path:
                raise PermissionError(13, "Permission denied", str(self))
            return real_open(self, *args, **kwargs)

        monkeypatch.setattr(Path, "open", denied)
    with pytest.raises(DataError, match=r"rows.jsonl cannot be read \(Permission denied\)"):
        list(iter_file(path, DataConfig()))


@pytest.mark.parametrize(
    ("record", "phrase"),
    [
        ({"meeting_transcripts": "A: hi", "general_query_list": [1]}, "not a {query, answer} object"),
        ({"meeting_transcripts": "A: hi", "general_query_list": [{"query": 1, "answer": 2}]}, "of text"),
        (
            {"meeting_transcripts": [{"speaker": {}, "content": "hi"}], "general_query_list": []},
            "speaker, content",
        ),
        ({"transcript": "A: hi", "sum\nmary": "x"}, "row has: sum\\nmary, transcript"),
    ],
)
def test_malformed_structured_fields_are_refused(record, phrase):
    with pytest.raises(DataError) as err:
        row_from_record(record, DataConfig(), "x.jsonl:1")
    assert phrase in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("data", "phrase"),
    [
        ("A: hi".encode("utf-16"), "--input {} is not UTF-8 text: it looks like UTF-16 text"),
        (b"\x00\x01\x02binary", "--input {} is not UTF-8 text: it looks like binary data"),
        (b"A: hi\nB: caf\xe9\n", "--input {}:2: not UTF-8 text (byte 0xE9 at column 7"),
    ],
)
def test_infer_input_that_is_not_utf8_text_is_refused(tmp_path, data, phrase):
    path = tmp_path / "meeting.txt"
    path.write_bytes(data)
    with pytest.raises(DataError) as err:
        read_input(str(path))
    assert phrase.format(path) in str(err.value)


def test_infer_input_text_reads(tmp_path):
    path = tmp_path / "meeting.txt"
    path.write_bytes(b"\xef\xbb\xbfA: caf\xc3\xa9\n")
    assert read_input(str(path)) == "A: caf\u00e9\n"


@pytest.mark.parametrize("suffix", [".CSV", ".Parquet", ".JSONL"])
def test_a_suffix_in_capitals_names_the_same_kind_of_file(tmp_path, suffix):
    """`MEETINGS.CSV` (as Windows and some exports write it) is read as a .csv file: by `--data`
    (`load_rows`), by `distft eval --data` and `infer --input` (`iter_file`)."""
    path = tmp_path / f"MEETINGS{suffix}"
    rows = [{**ROW, "summary": f"S{i}"} for i in range(8)]
    if suffix == ".CSV":
        cells = lambda text: '"' + text.replace('"', '""') + '"'  # noqa: E731
        path.write_text(
            "transcript,summary\n" + "".join(f"{cells(r['transcript'])},{r['summary']}\n" for r in rows)
        )
    elif suffix == ".Parquet":
        path.write_bytes(parquet(rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r.summary for r in iter_file(path, DataConfig())] == [f"S{i}" for i in range(8)]
    loaded = load_rows(DataConfig(source=str(path)))
    assert len(loaded["train"]) + len(loaded["validation"]) == 8


def test_a_named_pipe_is_called_one_everywhere_a_dataset_is_read(tmp_path):
    """Not "does not exist": a FIFO exists, and is read once (the cache's identity, then the rows)."""
    pipe = tmp_path / "rows.jsonl"
    os.mkfifo(pipe)
    for read in (
        lambda: load_rows(DataConfig(source=str(pipe))),  # distft train --data
        lambda: list(iter_file(pipe, DataConfig())),  # eval --data, data preview
    ):
        with pytest.raises(DataError, match=r"rows.jsonl is a named pipe, not a file: .* \(cat .* > rows"):
            read()
    with pytest.raises(DataError, match=r"rows\.jsonl does not exist"):
        load_rows(DataConfig(source=str(tmp_path / "missing" / "rows.jsonl")))
