"""Training data: meeting rows (`rows`), Qwen3 chat tokens with label masks (`chat`), the seeded
global batches every strategy shares (`batches`), the offline Qwen3 tokenizer (`tokenizer`) and the
bundled synthetic meetings (`sample`)."""

from distft.data.batches import (
    collate,
    count_label_tokens,
    document_ids,
    global_batch_indices,
    micro_batch,
    pack,
    rank_micro_batches,
)
from distft.data.chat import IGNORE, ChatFormatter, Example, TokenizedSplit, tokenize_rows
from distft.data.rows import KNOWN_SCHEMAS, MeetingRow, load_rows, row_from_record
from distft.data.tokenizer import load_tokenizer, qwen3_tokenizer

__all__ = [
    "IGNORE",
    "KNOWN_SCHEMAS",
    "ChatFormatter",
    "Example",
    "MeetingRow",
    "TokenizedSplit",
    "collate",
    "count_label_tokens",
    "document_ids",
    "global_batch_indices",
    "load_rows",
    "load_tokenizer",
    "micro_batch",
    "pack",
    "qwen3_tokenizer",
    "rank_micro_batches",
    "row_from_record",
    "tokenize_rows",
]
