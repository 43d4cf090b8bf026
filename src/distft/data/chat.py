"""Rows -> Qwen3 chat tokens with label masks: only the summary carries loss.

Each row becomes one Qwen3 chat: [system], user = instruction + transcript, assistant = summary.
Only the summary tokens (and the closing `<|im_end|>`) carry loss. Real AMI transcripts run ~10k
tokens (p90 ~15k), so a transcript that does not fit `max_length` is cut by `data.truncation`
(head / tail / middle); the summary is never cut.

Labels are stored already shifted (labels[t] is the token position t predicts), so strategies
that split the sequence (SP) or the layer stack (PP) need no shift of their own.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from distft.config import DataConfig
from distft.data.rows import MeetingRow
from distft.errors import DataError

IGNORE = -100
MIN_TRANSCRIPT_TOKENS = 32  # below this a "summary" of the transcript is meaningless
_PLACEHOLDER = "\x00TRANSCRIPT\x00"


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]  # shifted: labels[t] is the target of position t, IGNORE where no loss
    truncated_tokens: int  # transcript tokens dropped to fit max_length


class ChatFormatter:
    """Qwen3 chat prompts around a transcript, tokenised once and reused for every row."""

    def __init__(self, tokenizer: Any, cfg: DataConfig):
        self.tokenizer = tokenizer
        self.cfg = cfg
        messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
        messages.append({"role": "user", "content": f"{cfg.instruction}\n\n{_PLACEHOLDER}"})
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        before, after = text.split(_PLACEHOLDER)
        self.prefix = tokenizer.encode(before, add_special_tokens=False)
        self.suffix = tokenizer.encode(after, add_special_tokens=False)
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def _fit(self, transcript_ids: list[int], budget: int) -> list[int]:
        if len(transcript_ids) <= budget:
            return transcript_ids
        if self.cfg.truncation == "head":
            return transcript_ids[:budget]
        if self.cfg.truncation == "tail":
            return transcript_ids[-budget:]
        head = budget // 2
        return transcript_ids[:head] + transcript_ids[len(transcript_ids) - (budget - head) :]

    def prompt_ids(self, transcript: str, reserve: int = 0) -> list[int]:
        """The generation prompt for `transcript`, leaving `reserve` tokens of max_length free."""
        budget = self.cfg.max_length - len(self.prefix) - len(self.suffix) - reserve
        ids = self.tokenizer.encode(transcript, add_special_tokens=False)
        return self.prefix + self._fit(ids, max(budget, MIN_TRANSCRIPT_TOKENS)) + self.suffix

    def encode(self, row: MeetingRow) -> Example:
        transcript = self.tokenizer.encode(row.transcript, add_special_tokens=False)
        answer = [*self.tokenizer.encode(row.summary, add_special_tokens=False), self.end_id]
        budget = self.cfg.max_length - len(self.prefix) - len(self.suffix) - len(answer)
        if budget < MIN_TRANSCRIPT_TOKENS:
            raise DataError(
                f"{row.origin}: the prompt ({len(self.prefix) + len(self.suffix)} tokens) and the summary "
                f"({len(answer)} tokens) leave {max(budget, 0)} of data.max_length={self.cfg.max_length} "
                f"tokens for the transcript (at least {MIN_TRANSCRIPT_TOKENS} needed). Raise data.max_length."
            )
        kept = self._fit(transcript, budget)
        prompt = self.prefix + kept + self.suffix
        input_ids = prompt + answer
        # Position t predicts token t+1: the last prompt position predicts the first summary token.
        labels = [IGNORE] * (len(prompt) - 1) + answer + [IGNORE]
        return Example(input_ids, labels, len(transcript) - len(kept))


@dataclass
class TokenizedSplit:
    examples: list[Example]

    def summary(self) -> dict[str, float]:
        lengths = [len(e.input_ids) for e in self.examples]
        truncated = [e.truncated_tokens for e in self.examples if e.truncated_tokens]
        return {
            "rows": len(self.examples),
            "tokens_median": statistics.median(lengths),
            "tokens_max": max(lengths),
            "truncated_rows": len(truncated),
            "truncated_tokens_mean": statistics.mean(truncated) if truncated else 0.0,
            "truncated_tokens_max": max(truncated, default=0),
        }


def tokenize_rows(rows: list[MeetingRow], formatter: ChatFormatter) -> TokenizedSplit:
    return TokenizedSplit([formatter.encode(r) for r in rows])
