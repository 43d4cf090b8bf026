"""`dpo.max_prompt_length` and `dpo.max_completion_length`: a preference row's prompt and answers
cut by tokens, as TRL's DPOConfig cuts them, before data.max_length applies.

The prompt keeps its end (what the answer follows), each answer its start. A pair's two sequences
(KTO: an answer and its mismatched one) keep the same prompt tokens, so what they share is still
their prompt (`distft.data.pairs`). Which tokens are the prompt is told by a probe, the prompt
followed by a one-character answer, encoded beside them: the tokens it shares with the first
sequence. With either limit set, the chats are encoded whole and cut here; a sequence still above
data.max_length then loses more of its prompt's start, and answers that leave the prompt fewer than
`MIN_PROMPT_TOKENS` of it are skipped (data.skip_long_rows) or refused, naming the row.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from distft.config import DataConfig
from distft.config.preference import PreferenceConfig
from distft.data.chat import IGNORE, ChatFormatter, Example
from distft.data.truncation import MIN_PROMPT_TOKENS
from distft.errors import DataError


def shared_tokens(a: Example, b: Example) -> int:
    """The position that predicts the first token where `a` and `b` differ (position t predicts
    token t+1): every label before it is on tokens both share."""
    shared = 0
    for x, y in zip(a.input_ids, b.input_ids, strict=False):
        if x != y:
            break
        shared += 1
    return max(shared - 1, 0)


def cuts(limits: PreferenceConfig | None) -> bool:
    return limits is not None and bool(limits.max_prompt_length or limits.max_completion_length)


def limited_encoder(formatter: ChatFormatter, limits: PreferenceConfig | None) -> tuple[ChatFormatter, bool]:
    """What encodes the rows, and whether each needs its probe: under a limit the whole chats,
    cut after (`within_limits`); else `formatter`, which cuts to data.max_length."""
    if not cuts(limits):
        return formatter, False
    return ChatFormatter(formatter.tokenizer, replace(formatter.cfg, max_length=sys.maxsize)), True


def within_limits(
    sequences: list[Example | None], cfg: DataConfig, limits: PreferenceConfig | None, origin: str
) -> list[Example] | None:
    """Sequences of one prompt, the last its probe, cut to `limits` and data.max_length. None: one
    was skipped as too long, or is now (data.skip_long_rows). Unchanged without limits."""
    if None in sequences or not cuts(limits):
        return None if None in sequences else sequences
    prompt = shared_tokens(sequences[0], sequences[-1]) + 1  # the probe's answer differs at once
    answer = limits.max_completion_length or sys.maxsize
    longest = max(min(len(e.input_ids) - prompt, answer) for e in sequences)
    room, needed = cfg.max_length - longest, min(prompt, MIN_PROMPT_TOKENS)
    if room < needed:
        if cfg.skip_long_rows:
            return None
        raise DataError(
            f"{origin}: the longest answer ({longest} tokens, dpo.max_completion_length="
            f"{limits.max_completion_length}) leaves {max(room, 0)} of data.max_length={cfg.max_length} "
            f"tokens for the prompt (at least {needed} needed). Raise data.max_length, lower "
            "dpo.max_completion_length, or skip such rows with data.skip_long_rows=true."
        )
    keep = min(prompt, limits.max_prompt_length or prompt, room)
    return [_cut(e, prompt, keep, answer) for e in sequences]


def _cut(e: Example, prompt: int, keep: int, answer: int) -> Example:
    """`e`, whose first `prompt` tokens are its prompt, with that prompt's last `keep` tokens and
    its answer's first `answer`; each label stays with the token it predicts."""
    positions = [*range(prompt - keep, prompt), *range(prompt, min(len(e.input_ids), prompt + answer))]
    target = [False, *(t != IGNORE for t in e.labels[:-1])]  # labels are shifted: token t's is at t-1
    ids = [e.input_ids[p] for p in positions]
    kept = [target[p] for p in positions]
    labels = [ids[t + 1] if kept[t + 1] else IGNORE for t in range(len(ids) - 1)]
    return Example(ids, [*labels, IGNORE], e.truncated_tokens + len(e.input_ids) - len(ids))
