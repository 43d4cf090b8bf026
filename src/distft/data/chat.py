"""Rows -> chat tokens with label masks: the assistant's words carry loss (all, `data.train_on_inputs`).

Every row is a conversation (`distft.data.formats.messages_of`): a meeting becomes [system],
user = instruction + transcript, assistant = summary; a chat row is its own turns. The chat
template (`tokenizer.apply_chat_template`: the model directory's own, Qwen3's for presets, or
`data.chat_template` in their place: `distft.data.tokenizer`) renders it with a marker in place
of each text, so the template's own tokens and each text are tokenised apart and every token
knows where it came from. What carries loss: each assistant turn's content and the template's
text after it up to its end-of-turn token (`<|im_end|>`, `<|eot_id|>`, `</s>`: read from the
template, `distft.data.template`), and whatever the template opens an answer with beyond the
generation prompt (Qwen3's think block with `data.enable_thinking`). System and user turns carry
none, unless `data.train_on_inputs`: then every token of the rendered chat is a target (each
position predicts the next), prompt included.

Truncation is a policy, counted per row: a chat drops its earliest exchanges first (never the
last user turn or the final answer); then the longest prompt text (the transcript, a prompt,
alpaca's input) is cut by `data.truncation` (head / tail / middle). Assistant text is never cut;
a row whose answer alone leaves no room is refused with its origin.

A plain-text row (`TextRow`) takes no template: its tokens and the tokenizer's end-of-sequence
token, every one a target; a longer text is cut to max_length by `data.truncation`.

With `data.skip_long_rows` a row whose answer cannot fit is skipped (`encode_many` gives None for
it) and counted in the split's summary, instead of refused.

Labels are stored already shifted (labels[t] is the token position t predicts), so strategies
that split the sequence (SP) or the layer stack (PP) need no shift of their own.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from distft.config import DataConfig
from distft.data.formats import Message, Row, SummaryRow, TextRow, messages_of
from distft.data.template import EndOfTurn, end_of_turn, marker, opening, render
from distft.data.tokenizer import with_chat_template
from distft.errors import DataError

IGNORE = -100
MIN_PROMPT_TOKENS = 32  # below this, what is left of a cut prompt text is meaningless
_SLOT = re.compile("\x00(\\d+):(\\d+)\x00")  # the marker of part j of message i (`template.marker`)


class RowTooLong(DataError):
    """A row whose answer leaves too little of max_length for its prompt (skipped with data.skip_long_rows)."""


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]  # shifted: labels[t] is the target of position t, IGNORE where no loss
    truncated_tokens: int  # prompt tokens dropped to fit max_length (earlier turns, cut text)


@dataclass
class _Piece:
    """A run of tokens from one source: template text, or one text of one message."""

    ids: Sequence[int]
    target: bool = False  # carries loss
    part: tuple[int, int] | None = None  # (message, part) of a prompt text truncation may cut (a
    # text's piece is its own; a template piece, never cut, is shared by every chat of its shape)


class ChatFormatter:
    """Conversations -> token ids and shifted labels, through the tokenizer's chat template."""

    def __init__(self, tokenizer: Any, cfg: DataConfig):
        self.tokenizer = with_chat_template(tokenizer, cfg.chat_template)  # data.chat_template, if set
        self.cfg = cfg
        # The template only ever sees markers, so what it renders is a function of the chat's shape
        # (each message's role and part count): rendered, cut and tokenised once per shape.
        self._plans: dict[tuple, list[_Piece | tuple[int, int]]] = {}
        self._known: dict[str, Sequence[int]] = {}  # the texts of the rows `encode_many` is encoding

    @cached_property
    def end(self) -> EndOfTurn:
        """The template's end-of-turn token, read once it is needed (plain text needs none)."""
        return end_of_turn(self.tokenizer)

    @property
    def end_id(self) -> int:
        return self.end.id

    # ---- rendering ----------------------------------------------------------------------------

    def _ids(self, text: str) -> Sequence[int]:
        if not text:
            return ()
        ids = self._known.get(text)
        return ids if ids is not None else self.tokenizer.encode(text, add_special_tokens=False)

    def _plan(self, messages: list[Message], generation: bool) -> list[_Piece | tuple[int, int]]:
        """The chat's template pieces, with (message, part) where each text goes."""
        shape = (tuple((m.role, len(m.parts)) for m in messages), generation)
        plan = self._plans.get(shape)
        if plan is None:
            slots = [
                {"role": m.role, "content": "\n\n".join(marker(i, j) for j in range(len(m.parts)))}
                for i, m in enumerate(messages)
            ]
            thinking = self.cfg.enable_thinking
            text = render(self.tokenizer, slots, generation, thinking)
            openings = {  # a generation prompt trains nothing: its answers' openings do not matter
                i: opening(self.tokenizer, slots, i, text, thinking)
                for i, m in enumerate(messages)
                if m.role == "assistant" and not generation
            }
            chunks = _SLOT.split(text)  # literal, i, j, literal, i, j, ..., literal
            plan = []
            for k in range(0, len(chunks), 3):
                before = (int(chunks[k - 2]), int(chunks[k - 1])) if k else None
                after = (int(chunks[k + 1]), int(chunks[k + 2])) if k + 1 < len(chunks) else None
                plan += self._template_text(chunks[k], messages, before, after, openings)
                if after is not None:
                    plan.append(after)
            if len(self._plans) < 10_000:  # shapes are few; a bound all the same
                self._plans[shape] = plan
        return plan

    def _pieces(self, messages: list[Message], generation: bool) -> list[_Piece]:
        """The chat as pieces; a training chat (`generation=False`) ends at its last target token."""
        pieces: list[_Piece] = []
        for item in self._plan(messages, generation):
            if isinstance(item, _Piece):
                pieces.append(item)  # a template piece, shared by every chat of this shape
            else:
                i, j = item
                answer = messages[i].role == "assistant"
                pieces.append(_Piece(self._ids(messages[i].parts[j]), answer, None if answer else item))
        while not generation and pieces and not pieces[-1].target:
            pieces.pop()  # the template's "\n" after the last end-of-turn token predicts nothing
        return pieces

    def _template_text(
        self, text: str, messages: list[Message], before, after, openings: dict[int, str]
    ) -> list[_Piece]:
        """Template text between two message texts. Closing an answer, it starts with the text up to
        that answer's end-of-turn token (a target); opening one, it ends with the answer's opening
        (a target: Qwen3's think block with thinking on)."""
        in_answer = before and after and before[0] == after[0] and messages[before[0]].role == "assistant"
        if in_answer:
            return [_Piece(self._ids(text), target=True)]
        head = ""
        end = self.end.token
        if before and messages[before[0]].role == "assistant" and end in text:
            cut = text.index(end) + len(end)
            head, text = text[:cut], text[cut:]
        start = openings.get(after[0], "") if after and after[1] == 0 else ""
        if not text.endswith(start):  # the opening follows the end of an earlier turn: none here
            start = ""
        text = text[: len(text) - len(start)]
        pieces = [_Piece(self._ids(head), True), _Piece(self._ids(text)), _Piece(self._ids(start), True)]
        return [p for p in pieces if p.ids]

    # ---- truncation ---------------------------------------------------------------------------

    def _fit(self, ids: list[int], budget: int) -> list[int]:
        if len(ids) <= budget:
            return ids
        if self.cfg.truncation == "head":
            return ids[:budget]
        if self.cfg.truncation == "tail":
            return ids[-budget:]
        head = budget // 2
        return ids[:head] + ids[len(ids) - (budget - head) :]

    def _cut_longest(self, pieces: list[_Piece], over: int, origin: str | None) -> None:
        """Cut `over` tokens from the longest prompt text; refuse (with `origin`) if too little is left."""
        cuttable = [p for p in pieces if p.part is not None]
        longest = max(cuttable, key=lambda p: len(p.ids), default=None)
        keep = len(longest.ids) - over if longest else 0
        if origin is None:  # a generation prompt: keep at least a little of the text, whatever it costs
            keep = max(keep, MIN_PROMPT_TOKENS)
        elif keep < MIN_PROMPT_TOKENS:
            answer = sum(len(p.ids) for p in pieces if p.target)
            rest = _length(pieces) - answer - (len(longest.ids) if longest else 0)
            raise RowTooLong(
                f"{origin}: the answer ({answer} tokens) and the rest of the prompt ({rest} tokens) leave "
                f"{max(keep, 0)} of data.max_length={self.cfg.max_length} tokens for its longest prompt text "
                f"(at least {MIN_PROMPT_TOKENS} needed). Raise data.max_length, or skip such rows with "
                "data.skip_long_rows=true."
            )
        if longest:
            longest.ids = self._fit(longest.ids, keep)

    # ---- the API ------------------------------------------------------------------------------

    def encode(self, row: Row) -> Example:
        """A training example: the whole chat, labels on the assistant tokens, cut to max_length."""
        if isinstance(row, TextRow):
            return self._encode_text(row)
        messages = list(messages_of(row, self.cfg))
        pieces = self._pieces(messages, generation=False)
        full = _length(pieces)
        while _length(pieces) > self.cfg.max_length and _drop_earliest_exchange(messages):
            pieces = self._pieces(messages, generation=False)
        if _length(pieces) > self.cfg.max_length:
            self._cut_longest(pieces, _length(pieces) - self.cfg.max_length, row.origin)
        input_ids = [t for p in pieces for t in p.ids]
        target = [self.cfg.train_on_inputs or p.target for p in pieces for _ in p.ids]  # the prompt too?
        # Position t predicts token t+1: a label wherever the next token is a target.
        labels = [input_ids[t + 1] if target[t + 1] else IGNORE for t in range(len(input_ids) - 1)]
        return Example(input_ids, [*labels, IGNORE], full - len(input_ids))

    def _encode_text(self, row: TextRow) -> Example:
        """Plain text: its tokens and end-of-sequence, all targets, cut by data.truncation to fit."""
        eos = [] if self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id]
        ids = list(self._ids(row.text))
        full = len(ids) + len(eos)
        ids = self._fit(ids, self.cfg.max_length - len(eos)) + eos
        return Example(ids, [*ids[1:], IGNORE], full - len(ids))

    def _encode_or_skip(self, row: Row) -> Example | None:
        try:
            return self.encode(row)
        except RowTooLong:
            if self.cfg.skip_long_rows:
                return None
            raise

    def encode_many(self, rows: Sequence[Row]) -> list[Example | None]:
        """`encode` for each row, the rows' texts tokenised first in one call: a call costs the
        tokenizer far more than a short text does. None: a row skipped (data.skip_long_rows)."""
        texts = list({p for r in rows for m in messages_of(r, self.cfg) for p in m.parts if p})
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        self._known = dict(zip(texts, ids, strict=True))
        try:
            return [self._encode_or_skip(r) for r in rows]
        finally:
            self._known = {}

    def generation_prompt(self, messages: list[Message], reserve: int = 0) -> tuple[list[int], int]:
        """The prompt that asks for the next assistant turn, leaving `reserve` of max_length free,
        cut as training cuts (earliest exchanges, then the longest prompt text); and how many
        tokens were dropped to fit."""
        messages = list(messages)
        budget = self.cfg.max_length - reserve
        pieces = self._pieces(messages, generation=True)
        full = _length(pieces)
        while _length(pieces) > budget and _drop_earliest_exchange(messages):
            pieces = self._pieces(messages, generation=True)
        if _length(pieces) > budget:
            self._cut_longest(pieces, _length(pieces) - budget, origin=None)
        ids = [t for p in pieces for t in p.ids]
        return ids, full - len(ids)

    def generation_ids(self, messages: list[Message], reserve: int = 0) -> list[int]:
        """The prompt that asks for the next assistant turn, leaving `reserve` of max_length free."""
        return self.generation_prompt(messages, reserve)[0]

    def prompt_ids(self, transcript: str, reserve: int = 0) -> list[int]:
        """The generation prompt for a meeting `transcript`, leaving `reserve` tokens of max_length free."""
        messages = messages_of(SummaryRow(transcript, "", "prompt"), self.cfg)
        return self.generation_ids(list(messages[:-1]), reserve)


def _length(pieces: list[_Piece]) -> int:
    return sum(len(p.ids) for p in pieces)


def _drop_earliest_exchange(messages: list[Message]) -> bool:
    """Drop the turns before the second user turn (system messages at the top stay); False if
    the chat has a single user turn left."""
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    if len(users) < 2:
        return False
    start = next(i for i, m in enumerate(messages) if m.role != "system")
    del messages[start : users[1]]
    return True


SKIPPED_NAMED = 5  # the first skipped rows' origins a summary names


def skipped_line(summaries: dict[str, dict]) -> str:
    """One line on the rows skipped as too long (data.skip_long_rows): how many, the first few; "" if none."""
    skipped = {name: s.get("skipped_rows", 0) for name, s in summaries.items()}
    if not any(skipped.values()):
        return ""
    first = [origin for s in summaries.values() for origin in s.get("skipped_first", [])][:SKIPPED_NAMED]
    counts = ", ".join(f"{n} {name}" for name, n in skipped.items() if n)
    return f"skipped {counts} row(s) whose answer cannot fit data.max_length (data.skip_long_rows): {', '.join(first)}"


def split_summary(lengths: list[int], truncated: list[int], skipped: Sequence[str] = ()) -> dict:
    """What the run's header says of a split: rows, token lengths, rows and tokens cut, and the rows
    skipped as too long (data.skip_long_rows): how many, and the first few origins."""
    cut = [t for t in truncated if t]
    return {
        "rows": len(lengths),
        "tokens_median": statistics.median(lengths) if lengths else 0,
        "tokens_max": max(lengths, default=0),
        "tokens_total": sum(lengths),
        "tokens_whole_max": max(map(sum, zip(lengths, truncated, strict=True)), default=0),  # before any cut
        "truncated_rows": len(cut),
        "truncated_tokens_mean": statistics.mean(cut) if cut else 0.0,
        "truncated_tokens_max": max(cut, default=0),
        "skipped_rows": len(skipped),
        "skipped_first": list(skipped[:SKIPPED_NAMED]),
    }


@dataclass
class TokenizedSplit:
    """A split's examples in memory. Read by position like its memory-mapped twin
    (`distft.data.store.CachedSplit`), which the loop cannot tell from it."""

    examples: list[Example]
    skipped: list[str] = field(default_factory=list)  # origins of the rows skipped as too long
    reads: int = field(default=0, compare=False)  # examples handed out by position (the loop's batches)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Example:
        self.reads += 1
        return self.examples[i]

    def label_count(self, i: int) -> int:
        """Positions of example `i` that carry a label (not counted as a read)."""
        return sum(t != IGNORE for t in self.examples[i].labels)

    def summary(self) -> dict[str, float]:
        return split_summary(
            [len(e.input_ids) for e in self.examples],
            [e.truncated_tokens for e in self.examples],
            self.skipped,
        )


ENCODE_CHUNK = 512  # rows whose texts are tokenised in one call


def tokenize_rows(rows: Sequence[Row], formatter: ChatFormatter) -> TokenizedSplit:
    examples, skipped = [], []
    for i in range(0, len(rows), ENCODE_CHUNK):
        chunk = rows[i : i + ENCODE_CHUNK]
        for row, example in zip(chunk, formatter.encode_many(chunk), strict=True):
            if example is None:
                skipped.append(row.origin)
            else:
                examples.append(example)
    return TokenizedSplit(examples, skipped)
