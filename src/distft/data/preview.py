"""What a run trains on, shown before it does: the rows of the training split, their format, and
which of their tokens carry loss (`distft data preview`, and the format in the run's header).

A label mask is easy to get wrong and invisible in the loss curve: a template whose end-of-turn
token is not a target, a prompt that carries loss, an answer cut away by truncation. So the
preview decodes the example exactly as training builds it (`ChatFormatter.encode`) and marks the
tokens that carry loss, rather than re-deriving them from the row. A pair shows both its sides as
`train.objective` trains them (`sequences`): under dpo and orpo each answer after what the two
share (`encode_pairs`), under kto each answer against its prompt (`encode_completions`), under sft
the chosen one, the rejected side shown with nothing trained.

Rows are taken from the training split in the order the source holds them (not the order the
run draws them): `preview.jsonl:1` is the first line of the file unless it is held out for
validation. Only the rows shown are kept in memory; a source without a validation split of its
own is read twice (once to count its rows, whose seeded permutation is the split, as
`distft.data.rows.validation_rows` does).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from distft.config import DataConfig
from distft.config.choices import PAIRED
from distft.config.preference import PreferenceConfig
from distft.data.chat import IGNORE, ChatFormatter, Example, RowTooLong
from distft.data.formats import ChatRow, Row, row_format
from distft.data.mixture import source_configs
from distft.data.pairs import encode_completions, encode_pairs
from distft.data.preference import PreferenceRow, UnpairedRow, unpaired
from distft.data.rows import MEMORY, held_out, row_source
from distft.errors import DataError


def training_rows(cfg: DataConfig, seed: int = 0, limit: int = 1) -> list[Row]:
    """The first `limit` rows of the training split, in the source's order: held-out rows and rows
    past `data.max_rows` skipped. A mixture: its sources' training rows in turn (each source as
    the mixture draws from it)."""
    if cfg.sources:
        rows: list[Row] = []
        for sub in source_configs(cfg):
            rows += training_rows(sub, seed, limit - len(rows)) if len(rows) < limit else []
        return rows
    source = row_source(cfg)
    if "all" not in source.parts:  # a split of its own: its first rows, max_rows the first of those
        return list(itertools.islice(source.parts["train"](), min(limit, cfg.max_rows or limit)))
    read = source.parts["all"]
    n = sum(1 for _ in read())
    if source.too_few and n < 2:
        raise DataError(source.too_few.format(n=n))
    train, _ = held_out(n, cfg.validation_fraction, seed)
    kept = set((train[: cfg.max_rows] if cfg.max_rows else train).tolist())
    return list(itertools.islice((row for i, row in enumerate(read()) if i in kept), limit))


def data_format(cfg: DataConfig) -> str:
    """The rows' format as the run's header names it: `data.format` when set; under auto, the
    format of the source's first row, "(detected)"; a mixture, each source's in turn. Reads one
    row (a hub set is opened, as training opens it); "auto" when none can be read here (rows
    handed to `train()` from Python, a source that fails: training reports that itself)."""
    if cfg.sources:
        return ", ".join(data_format(sub) for sub in source_configs(cfg))
    if cfg.format != "auto":
        return cfg.format
    if cfg.source.startswith(MEMORY):
        return "auto (detected per row)"
    try:
        source = row_source(cfg)
        read = source.parts.get("train") or source.parts["all"]
        first = next(read(), None)
    except DataError:
        return "auto"
    return f"{row_format(first)} (detected)" if first is not None else "auto"


@dataclass(frozen=True)
class Span:
    """A run of consecutive tokens of one example, all carrying loss or none."""

    start: int
    end: int
    trained: bool


def loss_spans(example: Example) -> list[Span]:
    """`example`'s tokens cut into runs by whether they carry loss. Labels are stored shifted
    (`labels[t]` is what position t predicts), so token t is trained when `labels[t - 1]` is set;
    the first token never is (nothing predicts it)."""
    trained = [False, *(label != IGNORE for label in example.labels[:-1])]
    spans, start = [], 0
    for t in range(1, len(trained) + 1):
        if t == len(trained) or trained[t] != trained[start]:
            spans.append(Span(start, t, trained[start]))
            start = t
    return spans


def decode(tokenizer, ids: Sequence[int]) -> str:
    """Token ids as text, the template's special tokens (`<|im_end|>`) kept: they are trained too."""
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


@dataclass(frozen=True)
class Shown:
    """One sequence a previewed row trains as: its name ("" for a row that is one), its example
    labelled as the run labels it (None: skipped as too long, data.skip_long_rows), and a note (on
    a sequence that is not trained, what it is)."""

    name: str
    example: Example | None
    note: str = ""


def sequences(
    formatter: ChatFormatter, row: Row, objective: str, limits: PreferenceConfig | None = None
) -> list[Shown]:
    """What `row` trains as under `objective`: a pair its chosen and its rejected answer (sft: the
    chosen only), KTO's unpaired row its answer, desirable or not, any other row itself; cut to
    `limits` (the run's `[dpo]`) as training cuts it. A row the objective cannot train on is
    refused as training refuses it."""
    if objective in PAIRED:
        pairs, _ = encode_pairs(formatter, [row], limits)
        chosen, rejected = (pairs[0].chosen, pairs[0].rejected) if pairs else (None, None)
        return [Shown("chosen", chosen), Shown("rejected", rejected)]
    if objective == "kto":
        pair = isinstance(row, PreferenceRow)
        shown = []
        for side, unit in (
            zip(("chosen", "rejected"), unpaired(row), strict=True) if pair else [("answer", row)]
        ):
            completions, _ = encode_completions(formatter, [unit], limits)  # refuses a row that is neither
            label = "desirable" if unit.desirable else "undesirable"
            shown.append(Shown(f"{side} ({label})", completions[0].example if completions else None))
        return shown
    (example,) = formatter.encode_many([row])
    if not isinstance(row, PreferenceRow | UnpairedRow):
        return [Shown("", example)]
    if isinstance(row, UnpairedRow):
        return [Shown("answer (desirable)", example)]
    note = "not trained: train.objective=sft learns the chosen answer (dpo, orpo and kto train both)"
    try:  # read, never trained: an SFT run does not even tokenise it
        (rejected,) = formatter.encode_many([ChatRow(row.rejected_messages, row.origin)])
    except RowTooLong:
        rejected = None
    if rejected is None:
        return [Shown("chosen", example), Shown("rejected", None, f"{note}; it cannot fit data.max_length")]
    rejected = Example(rejected.input_ids, [IGNORE] * len(rejected.labels), rejected.truncated_tokens)
    return [Shown("chosen", example), Shown("rejected", rejected, note)]
