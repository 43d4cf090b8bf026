"""The `[data]` section of the run configuration (`distft.config.schema`): where the rows come
from, how each is rendered and tokenised, and how batches are built from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DataConfig:
    source: str = "sample"
    """`sample` (bundled meetings), `sample-pairs` (them as preference pairs), `sample-long` (whole
    meetings of 4k-28k tokens), a .jsonl/.parquet/.csv file, or a hub id."""
    transcript_field: str = ""
    """Field holding the transcript; empty: detected from the known AMI schemas."""
    summary_field: str = ""
    """Field holding the reference summary; empty: detected from the known AMI schemas."""
    train_split: str = "train"
    """Split used for training (hub datasets)."""
    validation_split: str = "validation"
    """Split used for evaluation; a local file is split by `validation_fraction` instead."""
    validation_fraction: float = 0.1
    """Fraction of a single local file held out for validation."""
    max_length: int = 768
    """Tokens per example: prompt + transcript + summary. Longer transcripts are truncated."""
    truncation: str = "middle"
    """How an over-long transcript is cut: head (keep its start), tail (keep its end) or middle
    (keep both ends, drop the middle). The summary is never truncated."""
    system_prompt: str = "You are a helpful assistant that summarizes meeting transcripts."
    """System message of the chat prompt; empty for none."""
    instruction: str = "Summarize the following meeting transcript."
    """User instruction placed before the transcript."""
    train_on_inputs: bool = False
    """Loss on every token of a row, prompt included (system and user turns, the template's role
    headers), in every format; false: on the assistant's answers alone (text rows: every token
    either way). Padding never carries loss. Part of the token cache's key."""
    chat_template: str = ""
    """A Jinja chat template used instead of the tokenizer's own: inline (text holding `{{` or
    `{%`), or a .jinja/.j2/.txt file (a relative path: from where distft runs; the run's config
    records it absolute). Refused before launch if it does not parse or does not render the
    assistant's text. Saved with the run's tokenizer and in exports; part of the token cache's key.
    Empty: the tokenizer's own."""
    max_rows: int = 0
    """Use at most this many training rows (0: all)."""
    format: str = "auto"
    """Row format: summary (transcript -> summary), chat (`messages`), prompt_completion, alpaca
    (`instruction`, `input`, `output`), sharegpt (`conversations`), text (plain text, loss on every
    token), or auto: detected from each row's fields (docs/data.md)."""
    roles: dict[str, str] = field(default_factory=dict)
    """ShareGPT rows: turn names (`from`) -> system, user or assistant, on top of the defaults (system;
    human, user -> user; gpt, assistant, model, bot -> assistant), e.g. {narrator = "system"}."""
    sources: list[dict[str, Any]] = field(default_factory=list)
    """Several datasets mixed by weight instead of one `source`: [[data.sources]] tables with `source`,
    `weight` (default 1) and `format` (default data.format); the rule: docs/data.md, "Mixing"."""
    skip_long_rows: bool = False
    """Skip and count the rows whose answer cannot fit data.max_length even truncated, instead of
    refusing the run at the first one (the header names how many, and the first few)."""
    enable_thinking: bool = False
    """Qwen3 thinking mode, passed to the chat template: false pre-fills an empty think block in the
    prompt; true leaves it to the model, so the think block is part of the trained target."""
    packing: bool = True
    """Pack each micro-batch's sequences into one row, with no padding: position ids restart at
    every document and attention never crosses one (docs/packing.md). Same loss as padded rows, up
    to float summation order; false: one right-padded row per sequence."""
    cache: bool = True
    """Tokenise a file or hub set once into a memory-mapped cache that every rank and later run opens
    (docs/data.md, "Data at scale"); false: every rank tokenises every row in memory."""
    cache_dir: str = ""
    """Token caches' home (multi-node: a shared filesystem); empty: `$DISTFT_CACHE/tokens`, else
    `~/.cache/distft/tokens`."""
    streaming: bool = False
    """Hub datasets: stream rows into the token cache instead of downloading the set first."""
    revision: str = ""
    """Hub datasets: branch, tag or commit (empty: the default branch); part of the cache key."""
