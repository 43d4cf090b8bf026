"""Training data: rows in six formats (`formats`: summary, chat, prompt/completion, alpaca,
sharegpt, text), read from files (`files`), the hub or memory (`rows`), several mixed by weight
(`mixture`); chat tokens with label masks (`chat`), cut to fit (`truncation`), shown as training
sees them (`preview`), tokenised once into a memory-mapped store every rank opens (`cache`,
`store`), the seeded global batches every strategy shares (`batches`), the offline Qwen3
tokenizer (`tokenizer`, with Qwen3's chat template from `qwen3_template`) and the bundled
synthetic meetings (`sample`)."""

from distft.data.batches import (
    collate,
    count_label_tokens,
    global_batch_indices,
    label_positions,
    micro_batch,
    pack,
    rank_micro_batches,
)
from distft.data.cache import open_or_build, tokenized_splits
from distft.data.chat import IGNORE, ChatFormatter, Example, TokenizedSplit, skipped_line, tokenize_rows
from distft.data.files import iter_file
from distft.data.formats import (
    ChatRow,
    Message,
    Row,
    SummaryRow,
    prompt_and_reference,
    row_format,
    row_from_record,
)
from distft.data.mixture import data_name
from distft.data.preview import data_format, loss_spans, training_rows
from distft.data.rows import LOCAL_SUFFIXES, is_local_file, load_rows, validation_rows
from distft.data.store import CachedSplit, mean_label_tokens
from distft.data.template import check_chat_template, end_of_turn
from distft.data.tokenizer import load_tokenizer, qwen3_tokenizer
from distft.tensors import document_ids  # packed rows' documents (the model layer needs it too)

__all__ = [
    "IGNORE",
    "LOCAL_SUFFIXES",
    "CachedSplit",
    "ChatFormatter",
    "ChatRow",
    "Example",
    "Message",
    "Row",
    "SummaryRow",
    "TokenizedSplit",
    "check_chat_template",
    "collate",
    "count_label_tokens",
    "data_format",
    "data_name",
    "document_ids",
    "end_of_turn",
    "global_batch_indices",
    "is_local_file",
    "iter_file",
    "label_positions",
    "load_rows",
    "load_tokenizer",
    "loss_spans",
    "mean_label_tokens",
    "micro_batch",
    "open_or_build",
    "pack",
    "prompt_and_reference",
    "qwen3_tokenizer",
    "rank_micro_batches",
    "row_format",
    "row_from_record",
    "skipped_line",
    "tokenize_rows",
    "tokenized_splits",
    "training_rows",
    "validation_rows",
]
