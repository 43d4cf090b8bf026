"""What a file's bytes look like, so that a file which is not what its name says is refused with a
message that says what it is: UTF-16 text, a Parquet file named .jsonl, JSON lines named .parquet,
a gzip archive, binary data (`distft.data.files`, `distft.config.io`, `distft infer --input`).

`looks_like` reads a file's first bytes; `decode_utf8` turns a whole file into text, or raises the
caller's error class with the line and column of the first byte that is not UTF-8.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

HEAD_BYTES = 4096  # what `looks_like` is shown: the start of a file


@dataclass(frozen=True)
class Looks:
    """What a file seems to hold, from its first bytes."""

    what: str  # a phrase: "UTF-16 text", "a gzip archive", "JSON lines", ...
    text: bool = False  # text (UTF-8, or with a line saying where it is not): read it line by line
    advice: str = ""  # what to do about it, where it is not text


RESAVE = "re-save it as UTF-8"
PARQUET = Looks("a Parquet file", advice="distft reads it as Parquet when its name ends in .parquet")
EMPTY = Looks("an empty file", text=True)
JSON_LINES = Looks("JSON lines", text=True)
JSON_ARRAY = Looks("a JSON array", text=True)
TEXT = Looks("text", text=True)

# (leading bytes, what they mean), the longer of two that share a prefix first.
MAGIC: tuple[tuple[bytes, Looks], ...] = (
    (b"PAR1", PARQUET),
    (b"\xff\xfe\x00\x00", Looks("UTF-32 text (a little-endian byte-order mark)", advice=RESAVE)),
    (b"\x00\x00\xfe\xff", Looks("UTF-32 text (a big-endian byte-order mark)", advice=RESAVE)),
    (b"\xff\xfe", Looks("UTF-16 text (a little-endian byte-order mark)", advice=RESAVE)),
    (b"\xfe\xff", Looks("UTF-16 text (a big-endian byte-order mark)", advice=RESAVE)),
    (b"\x1f\x8b", Looks("a gzip archive", advice="decompress it first (gunzip)")),
    (b"\x28\xb5\x2f\xfd", Looks("a zstd archive", advice="decompress it first (unzstd)")),
    (b"BZh", Looks("a bzip2 archive", advice="decompress it first (bunzip2)")),
    (b"\xfd7zXZ\x00", Looks("an xz archive", advice="decompress it first (unxz)")),
    (b"PK\x03\x04", Looks("a zip archive (or a spreadsheet)", advice="export the rows as JSON lines")),
    (b"ARROW1", Looks("an Arrow IPC file", advice="write it as Parquet or JSON lines")),
    (b"SQLite format 3\x00", Looks("an SQLite database", advice="export the rows as JSON lines")),
)
CONTROL = bytes([*range(1, 9), *range(14, 27), *range(28, 32), 127])  # never in text (27: ESC, colours)
LATIN = "Latin-1 or Windows-1252, perhaps"


def looks_like(head: bytes) -> Looks:
    """What a file starting with `head` (its first `HEAD_BYTES` bytes, or all of a shorter one) holds."""
    if not head:
        return EMPTY
    for magic, looks in MAGIC:
        if head.startswith(magic):
            return looks
    if b"\x00" in head:
        # UTF-16 without a byte-order mark: ASCII characters leave every other byte NUL.
        for order, half in (("little", head[1::2]), ("big", head[0::2])):
            if half.count(0) >= 0.4 * len(half):
                return Looks(f"UTF-16 text ({order}-endian, no byte-order mark)", advice=RESAVE)
        return Looks(f"binary data (a NUL byte at offset {head.index(0)})")
    if sum(head.count(c) for c in CONTROL) > 0.1 * len(head):
        return Looks("binary data (control characters text has not)")
    try:  # an incremental decoder: a character cut at the end of `head` is no error
        text = codecs.getincrementaldecoder("utf-8-sig")().decode(head, final=False)
    except UnicodeDecodeError:
        return Looks(f"text in another encoding than UTF-8 ({LATIN})", text=True)  # lines say where
    start = text.lstrip(" \t\r\n")[:1]
    return {"{": JSON_LINES, "[": JSON_ARRAY}.get(start, TEXT)


def decode_utf8(data: bytes, name: str, error: type[ValueError]) -> str:
    """`data` (all of file `name`) as text, a leading byte-order mark dropped; `error` (the caller's
    ConfigError or DataError) when it is not UTF-8 text, naming what it looks like, or the line and
    column of the first byte that is not UTF-8."""
    looks = looks_like(data[:HEAD_BYTES])
    if not looks.text:
        advice = f"; {looks.advice}" if looks.advice else ""
        raise error(f"{name} is not UTF-8 text: it looks like {looks.what}{advice}.")
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise error(f"{not_utf8(data, err.start, f'{name}:{line}')}; {RESAVE}.") from None


def not_utf8(data: bytes, start: int, where: str) -> str:
    """The refusal of the byte at `start` of `data` (a line, or a whole file), "WHERE: not UTF-8 text
    (byte 0xE9 at column 7: ...)", its column counted from the line break before it."""
    begin = data.rfind(b"\n", 0, start) + 1
    column = len(data[begin:start].decode("utf-8", errors="replace")) + 1
    return f"{where}: not UTF-8 text (byte 0x{data[start]:02X} at column {column}: {LATIN})"
