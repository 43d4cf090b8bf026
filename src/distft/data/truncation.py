"""Truncation: what a row longer than data.max_length loses, counted per row.

A chat drops its earliest exchanges first (never the last user turn or the final answer); then
the longest prompt text (the transcript, a prompt, alpaca's input) is cut by `data.truncation`
(head / tail / middle). Assistant text is never cut; a row whose answer leaves too little room is
refused with its origin, or skipped with `data.skip_long_rows`. A plain-text row is cut whole.

The cut is made in the tokenization of the whole rendered text (`distft.data.chat`), so every
token kept is the one a server tokenising that text has there. The tokens either side of the cut
are kept as that tokenization has them; tokenising the cut text afresh may merge them otherwise
(a text's last kept characters with the template's text after it). A token belongs to the text it
starts in: one merging the template's text before a prompt text with the text's first characters
(Mistral's "[INST] " + "The" as " The") is the template's, never cut.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence

from distft.config import DataConfig
from distft.data.formats import Message
from distft.errors import DataError

MIN_PROMPT_TOKENS = 32  # below this, what is left of a cut prompt text is meaningless

Span = tuple[int, int]  # [start, end): of characters in a text, or of tokens in its tokenization


class RowTooLong(DataError):
    """A row whose answer leaves too little of max_length for its prompt (skipped with data.skip_long_rows)."""


def tokens_starting_in(offsets: Sequence[Span], chars: Span) -> Span:
    """The tokens whose first character lies in `chars` (each token's character span in `offsets`)."""
    return bisect_left(offsets, chars[0], key=_start), bisect_left(offsets, chars[1], key=_start)


def tokens_touching(offsets: Sequence[Span], chars: Span) -> Span:
    """The tokens with any character in `chars`."""
    return bisect_right(offsets, chars[0], key=_end), bisect_left(offsets, chars[1], key=_start)


def _start(span: Span) -> int:
    return span[0]


def _end(span: Span) -> int:
    return span[1]


def removed(tokens: Span, keep: int, policy: str) -> Span:
    """The tokens that cutting the run `tokens` down to `keep` by `policy` (data.truncation) removes."""
    lo, hi = tokens
    keep = min(max(keep, 0), hi - lo)
    head = keep if policy == "head" else 0 if policy == "tail" else keep // 2
    return lo + head, hi - (keep - head)


def cut_longest(
    offsets: Sequence[Span], prompts: list[Span], answer: int, over: int, cfg: DataConfig, origin: str | None
) -> Span:
    """The tokens to remove: `over` of the longest prompt text (`prompts`: each one's characters);
    refused (with `origin`) if too little of it is left. `answer`: the tokens carrying loss. A
    generation prompt (`origin` None) keeps at least a little of the text, whatever it costs."""
    spans = [tokens_starting_in(offsets, chars) for chars in prompts]
    longest = max(spans, key=lambda s: s[1] - s[0], default=(0, 0))
    keep = longest[1] - longest[0] - over
    if origin is None:
        keep = max(keep, MIN_PROMPT_TOKENS)
    elif keep < MIN_PROMPT_TOKENS:
        rest = len(offsets) - answer - (longest[1] - longest[0])
        raise RowTooLong(
            f"{origin}: the answer ({answer} tokens) and the rest of the prompt ({rest} tokens) leave "
            f"{max(keep, 0)} of data.max_length={cfg.max_length} tokens for its longest prompt text "
            f"(at least {MIN_PROMPT_TOKENS} needed). Raise data.max_length, or skip such rows with "
            "data.skip_long_rows=true."
        )
    return removed(longest, keep, cfg.truncation)


def drop_earliest_exchange(messages: list[Message]) -> bool:
    """Drop the turns before the second user turn (system messages at the top stay); False if
    the chat has a single user turn left."""
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    if len(users) < 2:
        return False
    start = next(i for i, m in enumerate(messages) if m.role != "system")
    del messages[start : users[1]]
    return True
