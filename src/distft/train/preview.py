"""`distft data preview`: the first rows of the training split, tokenised as the run will tokenise
them, with the tokens that carry loss marked.

It reads the same settings as `distft train` (defaults, `--config`, `section.key=value`
overrides, `--model`, `--data`), uses the model's tokenizer and chat template as training does
(`distft.train.prepare`), and prints for each row its origin and format, the decoded example
with every run of trained tokens wrapped in `[[...]]` (highlighted on a terminal), and its counts:
tokens, tokens that carry loss, and what truncation cut. A pair shows its chosen and its rejected
side, each so, as `train.objective` trains them (`distft.data.preview.sequences`). Nothing is
trained and nothing written; no model weights are loaded.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.text import Text

from distft.config import Config, DataConfig, load_config
from distft.config.choices import ITEM_NAMES, PAIRED
from distft.data import (
    ChatFormatter,
    Row,
    check_chat_template,
    data_format,
    data_name,
    load_tokenizer,
    loss_spans,
    row_format,
    training_rows,
)
from distft.data.chat import Example
from distft.data.limits import cuts
from distft.data.preview import Shown, decode, sequences
from distft.data.tokenizer import with_added_tokens
from distft.errors import ConfigError
from distft.model import is_preset, tokenizer_ranks
from distft.text import plural

OPEN, CLOSE = "[[", "]]"  # around each run of tokens that carry loss
PREVIEW_FLAGS = {"model": "model.name", "data": "data.source"}  # flag -> the config field it sets


def cmd_data(args: argparse.Namespace) -> int:
    """`distft data preview` (the one `data` command)."""
    if args.rows < 1:
        raise ConfigError(f"--rows must be at least 1, got {args.rows}: it is how many rows to show.")
    flags = [f"{field}={getattr(args, flag)}" for flag, field in PREVIEW_FLAGS.items() if getattr(args, flag)]
    cfg = load_config(args.config, [*args.overrides, *flags])
    name = cfg.model.name
    tokenizer = load_tokenizer(
        None if is_preset(name) else name, cfg.model.revision, ranks=tokenizer_ranks(name)
    )
    tokenizer = with_added_tokens(tokenizer, cfg.model.added_tokens)  # model.added_tokens
    check_chat_template(tokenizer, cfg.data)  # refused here as `distft train` refuses it
    rows = training_rows(cfg.data, cfg.train.seed, args.rows)
    console = Console(highlight=False, soft_wrap=True)  # no wrapping: the text is shown as it is
    console.print(header(cfg), markup=False)
    formatter = ChatFormatter(tokenizer, cfg.data)
    for i, row in enumerate(rows, start=1):
        console.print()
        for line in preview_row(formatter, row, i, cfg):
            console.print(line, markup=False)
    if len(rows) < args.rows:  # held-out rows and those past data.max_rows are not trained on
        console.print(
            f"\nthe training split has {plural(len(rows), _row_name(cfg))}, all shown", markup=False
        )
    return 0


def header(cfg: Config) -> str:
    """What every row below shares: the source, its format, the length policy, the tokenizer."""
    data: DataConfig = cfg.data
    inline = "{{" in data.chat_template or "{%" in data.chat_template
    template = (
        "its chat template"
        if not data.chat_template
        else "the inline data.chat_template"
        if inline
        else f"the chat template of {data.chat_template}"
    )
    return (
        f"data: {data_name(data)}, format {data_format(data)}; max_length {data.max_length}, truncation "
        f"{data.truncation}; the tokenizer of {cfg.model.name}, {template}\n"
        f"the tokens inside {OPEN}...{CLOSE} carry loss; the rest is context the model reads"
    )


def _row_name(cfg: Config) -> str:
    """What a row of the data is to the run: a pair under dpo and orpo (KTO reads a pair as two
    answers, so a row there is a row)."""
    return ITEM_NAMES[cfg.train.objective] if cfg.train.objective in PAIRED else "row"


def preview_row(formatter: ChatFormatter, row: Row, i: int, cfg: Config) -> list[str | Text]:
    """Training row `i`: where it is from, the example with its trained tokens marked, its counts;
    a pair's sides (or KTO's answers) each so under its name, a blank line between them, cut to
    the run's `[dpo]` limits. A row that cannot fit is refused, as training refuses it."""
    lines: list[str | Text] = [f"--- training {_row_name(cfg)} {i}: {row.origin} ({row_format(row)}) ---"]
    policy = f"data.truncation={cfg.data.truncation}"
    if cfg.train.objective != "sft" and cuts(cfg.dpo):  # the prompt's start, the answers' end
        policy = f"dpo.max_prompt_length={cfg.dpo.max_prompt_length}, "
        policy += f"dpo.max_completion_length={cfg.dpo.max_completion_length}"
    for k, shown in enumerate(sequences(formatter, row, cfg.train.objective, cfg.dpo)):
        if k:
            lines.append("")
        if shown.name:
            lines.append(f"{shown.name}: {shown.note}" if shown.note else f"{shown.name}:")
        lines += example_lines(formatter, shown, policy)
    return lines


def example_lines(formatter: ChatFormatter, shown: Shown, policy: str) -> list[str | Text]:
    """One example with its trained tokens marked, and its counts (`policy`: the settings that cut
    it, if anything did); or why it is not shown (its note, else skipped as too long)."""
    example: Example | None = shown.example
    if example is None:
        return (
            []
            if shown.note
            else ["skipped: its answer cannot fit data.max_length (data.skip_long_rows=true)"]
        )
    text = Text()
    for span in loss_spans(example):
        piece = decode(formatter.tokenizer, example.input_ids[span.start : span.end])
        text.append(
            f"{OPEN}{piece}{CLOSE}" if span.trained else piece, style="bold green" if span.trained else ""
        )
    tokens, trained = len(example.input_ids), sum(s.end - s.start for s in loss_spans(example) if s.trained)
    cut = (
        f"truncated: {plural(example.truncated_tokens, 'token')} cut ({policy})"
        if example.truncated_tokens
        else "not truncated"
    )
    return [text, f"{plural(tokens, 'token')}, {trained:,} carry loss; {cut}"]
