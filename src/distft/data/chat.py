"""Rows -> chat tokens with label masks: the assistant's words carry loss (all, `data.train_on_inputs`).

Every row is a conversation (`distft.data.formats.messages_of`): a meeting becomes [system],
user = instruction + transcript, assistant = summary; a chat row is its own turns. The chat
template (`tokenizer.apply_chat_template`: the model directory's own, Qwen3's for presets, or
`data.chat_template` in their place: `distft.data.tokenizer`) renders the chat's shape once with a
marker in place of each text; the row's texts go in their places, so the rendered text is the
template's and every character knows where it came from. The whole text is tokenised at once, as
a server (llama.cpp, Ollama, vLLM) tokenises the prompt it renders: the ids trained on are the ids
served, even where a text's last characters merge with what follows (Qwen's "." "\n\n" is one
token). The tokenizer's character offsets say which tokens each text covers.

What carries loss: each assistant turn's content and the template's text after it up to its
end-of-turn token (`<|im_end|>`, `<|eot_id|>`, `</s>`: read from the template,
`distft.data.template`), and whatever the template opens an answer with beyond the generation
prompt (Qwen3's think block with `data.enable_thinking`); a token with any character of these is
a target. System and user turns carry none, unless `data.train_on_inputs`: then every token of the
rendered chat is a target (each position predicts the next), prompt included. A training chat ends
at its last target token.

A row longer than data.max_length is cut by `distft.data.truncation`. A plain-text row
(`TextRow`) takes no template: its tokens and the tokenizer's end-of-sequence token, every one a
target. With `data.skip_long_rows` a row whose answer cannot fit is skipped (`encode_many` gives
None for it) and counted in the split's summary, instead of refused.

Labels are stored already shifted (labels[t] is the token position t predicts), so strategies
that split the sequence (SP) or the layer stack (PP) need no shift of their own.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

from distft.config import DataConfig
from distft.data.chat_template import with_chat_template
from distft.data.formats import Message, Row, SummaryRow, TextRow, messages_of
from distft.data.template import EndOfTurn, end_of_turn, marker, opening, render
from distft.data.truncation import (
    RowTooLong,
    Span,
    cut_longest,
    drop_earliest_exchange,
    removed,
    tokens_touching,
)

IGNORE = -100
_SLOT = re.compile("\x00(\\d+):(\\d+)\x00")  # the marker of part j of message i (`template.marker`)


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]  # shifted: labels[t] is the target of position t, IGNORE where no loss
    truncated_tokens: int  # prompt tokens dropped to fit max_length (earlier turns, cut text)


class _Literal(NamedTuple):
    """Template text of a chat's shape; a target where it belongs to an answer."""

    text: str
    target: bool = False


@dataclass(frozen=True)
class _Rendered:
    """A chat's text, with the characters that carry loss and those truncation may cut."""

    text: str
    targets: list[Span]
    prompts: list[Span]  # each prompt text (a system or user message's part)


_Tokens = tuple[list[int], list[Span]]  # a text's ids and each one's characters


class ChatFormatter:
    """Conversations -> token ids and shifted labels, through the tokenizer's chat template."""

    def __init__(self, tokenizer: Any, cfg: DataConfig):
        self.tokenizer = with_chat_template(tokenizer, cfg.chat_template)  # data.chat_template, if set
        self.cfg = cfg
        # The template only ever sees markers, so what it renders is a function of the chat's shape
        # (each message's role and part count): rendered and cut once per shape.
        self._plans: dict[tuple, list[_Literal | tuple[int, int]]] = {}

    @cached_property
    def end(self) -> EndOfTurn:
        """The template's end-of-turn token, read once it is needed (plain text needs none)."""
        return end_of_turn(self.tokenizer)

    @property
    def end_id(self) -> int:
        return self.end.id

    # ---- rendering ----------------------------------------------------------------------------

    def _plan(self, messages: list[Message], generation: bool) -> list[_Literal | tuple[int, int]]:
        """The chat's template text, with (message, part) where each text goes."""
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

    def _template_text(
        self, text: str, messages: list[Message], before, after, openings: dict[int, str]
    ) -> list[_Literal]:
        """Template text between two message texts. Closing an answer, it starts with the text up to
        that answer's end-of-turn token (a target); opening one, it ends with the answer's opening
        (a target: Qwen3's think block with thinking on)."""
        in_answer = before and after and before[0] == after[0] and messages[before[0]].role == "assistant"
        if in_answer:
            return [_Literal(text, target=True)]
        head = ""
        end = self.end.token
        if before and messages[before[0]].role == "assistant" and end in text:
            cut = text.index(end) + len(end)
            head, text = text[:cut], text[cut:]
        start = openings.get(after[0], "") if after and after[1] == 0 else ""
        if not text.endswith(start):  # the opening follows the end of an earlier turn: none here
            start = ""
        text = text[: len(text) - len(start)]
        return [p for p in (_Literal(head, True), _Literal(text), _Literal(start, True)) if p.text]

    def _render(self, messages: list[Message], generation: bool) -> _Rendered:
        """The chat's text; a training chat (`generation=False`) ends at its last target character."""
        chunks, targets, prompts, at = [], [], [], 0
        for item in self._plan(messages, generation):
            if isinstance(item, _Literal):
                text, kind = item.text, targets if item.target else None
            else:
                message = messages[item[0]]
                text, kind = message.parts[item[1]], targets if message.role == "assistant" else prompts
            if text and kind is not None:
                kind.append((at, at + len(text)))
            chunks.append(text)
            at += len(text)
        text = "".join(chunks)
        if not generation:  # the template's "\n" after the last end-of-turn token predicts nothing
            text = text[: targets[-1][1] if targets else 0]
        return _Rendered(text, targets, prompts)

    def _tokenize(self, texts: list[str]) -> list[_Tokens]:
        """Each text's ids and their characters, in one call: a call costs the tokenizer far more
        than a short text does."""
        if not texts:
            return []
        batch = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        return list(zip(batch["input_ids"], batch["offset_mapping"], strict=True))

    def _fit(
        self, messages: list[Message], rendered: _Rendered, tokens: _Tokens, budget: int, origin: str | None
    ) -> tuple[list[int], list[bool], int]:
        """The chat's ids cut to `budget` (earliest exchanges, then the longest prompt text), whether
        each is a target, and the length of the whole chat. `origin` None: a generation prompt."""
        ids, offsets = tokens
        full = len(ids)
        while len(ids) > budget and drop_earliest_exchange(messages):
            rendered = self._render(messages, generation=origin is None)
            ids, offsets = self._tokenize([rendered.text])[0]
        target = [False] * len(ids)
        for chars in rendered.targets:
            # None of the bundled templates merges an answer's first characters with the prompt
            # before it into one token (it follows a special token or a newline); a token that did
            # would carry loss, so that the model learns to write all of the answer.
            lo, hi = tokens_touching(offsets, chars)
            target[lo:hi] = [True] * (hi - lo)
        if len(ids) > budget:
            lo, hi = cut_longest(offsets, rendered.prompts, sum(target), len(ids) - budget, self.cfg, origin)
            ids, target = ids[:lo] + ids[hi:], target[:lo] + target[hi:]
        return ids, target, full

    # ---- the API ------------------------------------------------------------------------------

    def encode(self, row: Row) -> Example:
        """A training example: the whole chat, labels on the assistant tokens, cut to max_length."""
        return self._examples([row], skip=False)[0]  # type: ignore[return-value]

    def encode_many(self, rows: Sequence[Row]) -> list[Example | None]:
        """`encode` for each row, the rows' texts tokenised in one call. None: a row skipped
        (data.skip_long_rows)."""
        return self._examples(rows, skip=self.cfg.skip_long_rows)

    def _examples(self, rows: Sequence[Row], skip: bool) -> list[Example | None]:
        chats = [None if isinstance(r, TextRow) else list(messages_of(r, self.cfg)) for r in rows]
        rendered = [None if m is None else self._render(m, generation=False) for m in chats]
        texts = [r.text if isinstance(r, TextRow) else x.text for r, x in zip(rows, rendered, strict=True)]
        examples: list[Example | None] = []
        for row, messages, chat, tokens in zip(rows, chats, rendered, self._tokenize(texts), strict=True):
            if messages is None:
                examples.append(self._text_example(tokens[0]))
                continue
            try:
                ids, target, full = self._fit(messages, chat, tokens, self.cfg.max_length, row.origin)
            except RowTooLong:
                if not skip:
                    raise
                examples.append(None)
                continue
            examples.append(self._example(ids, target, full))
        return examples

    def _example(self, ids: list[int], target: list[bool], full: int) -> Example:
        """Position t predicts token t+1: a label wherever the next token is a target (every token,
        the prompt's too, with data.train_on_inputs)."""
        if self.cfg.train_on_inputs:
            labels = ids[1:]
        else:
            labels = [i if t else IGNORE for i, t in zip(ids[1:], target[1:], strict=True)]
        return Example(ids, [*labels, IGNORE], full - len(ids))

    def _text_example(self, ids: list[int]) -> Example:
        """Plain text: its tokens and end-of-sequence, all targets, cut by data.truncation to fit."""
        eos = [] if self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id]
        full = len(ids) + len(eos)
        lo, hi = removed((0, len(ids)), self.cfg.max_length - len(eos), self.cfg.truncation)
        ids = ids[:lo] + ids[hi:] + eos
        return Example(ids, [*ids[1:], IGNORE], full - len(ids))

    def generation_prompt(self, messages: list[Message], reserve: int = 0) -> tuple[list[int], int]:
        """The prompt that asks for the next assistant turn, leaving `reserve` of max_length free,
        cut as training cuts (earliest exchanges, then the longest prompt text); and how many
        tokens were dropped to fit."""
        messages = list(messages)
        rendered = self._render(messages, generation=True)
        tokens = self._tokenize([rendered.text])[0]
        ids, _, full = self._fit(messages, rendered, tokens, self.cfg.max_length - reserve, origin=None)
        return ids, full - len(ids)

    def generation_ids(self, messages: list[Message], reserve: int = 0) -> list[int]:
        """The prompt that asks for the next assistant turn, leaving `reserve` of max_length free."""
        return self.generation_prompt(messages, reserve)[0]

    def prompt_ids(self, transcript: str, reserve: int = 0) -> list[int]:
        """The generation prompt for a meeting `transcript`, leaving `reserve` tokens of max_length free."""
        messages = messages_of(SummaryRow(transcript, "", "prompt"), self.cfg)
        return self.generation_ids(list(messages[:-1]), reserve)


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
