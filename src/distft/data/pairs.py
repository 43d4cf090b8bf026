"""Preference rows tokenised into pairs of examples: the chosen and the rejected conversation, each
through the chat template exactly as an SFT row is (`ChatFormatter`), then cut to their answers.

What the two share, token by token from the start, is the prompt: every label up to the first
token where they differ is dropped, so only the answers carry loss (a row with `prompt` shares at
least its turns; whole conversations share whatever they repeat, found here). The two sequences of
a pair always travel together: a batch of B pairs is one micro-batch of 2B rows, the chosen ones
first (`rows_of`), so both answers of a pair meet in one forward on one rank.

Pairs are tokenised in memory (the token cache holds single examples), before launch to name a bad
row by its origin, and again in each rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from distft.config import DataConfig
from distft.data.cache import tokenized_splits
from distft.data.chat import IGNORE, ChatFormatter, Example, split_summary
from distft.data.formats import ChatRow
from distft.data.mixture import data_name
from distft.data.preference import PreferenceRow
from distft.data.rows import check_splits, load_rows
from distft.errors import DataError


@dataclass(frozen=True)
class Pair:
    chosen: Example
    rejected: Example
    reference: tuple[float, float] | None = None  # DPO's precomputed reference log-probabilities


def answers_only(chosen: Example, rejected: Example, origin: str) -> Pair:
    """The pair with the labels of the tokens both share from the start dropped."""
    shared = 0
    for a, b in zip(chosen.input_ids, rejected.input_ids, strict=False):
        if a != b:
            break
        shared += 1
    # Position t predicts token t+1: the first differing token is predicted at position shared - 1.
    first = max(shared - 1, 0)

    def cut(e: Example) -> Example:
        labels = [IGNORE] * first + e.labels[first:]
        return Example(e.input_ids, labels, e.truncated_tokens)

    pair = Pair(cut(chosen), cut(rejected))
    for name, e in (("chosen", pair.chosen), ("rejected", pair.rejected)):
        if all(t == IGNORE for t in e.labels):
            raise DataError(
                f"{origin}: the {name} answer has no token of its own after the part both answers share "
                f"(the pair may have been cut to data.max_length)."
            )
    return pair


def encode_pairs(formatter: ChatFormatter, rows: list[PreferenceRow]) -> tuple[list[Pair], list[str]]:
    """Each preference row as a pair of examples (answers only), and the origins of the rows
    skipped as too long (`data.skip_long_rows`)."""
    for row in rows:
        if not isinstance(row, PreferenceRow):
            raise DataError(
                f"{row.origin}: a preference objective (train.objective) trains on pairs of answers "
                "({prompt, chosen, rejected}, docs/preference.md), and this row is not one."
            )
    chats = [ChatRow(m, r.origin) for r in rows for m in (r.chosen_messages, r.rejected_messages)]
    examples = formatter.encode_many(chats)
    pairs, skipped = [], []
    for row, chosen, rejected in zip(rows, examples[::2], examples[1::2], strict=True):
        if chosen is None or rejected is None:
            skipped.append(row.origin)
        else:
            pairs.append(answers_only(chosen, rejected, row.origin))
    return pairs, skipped


def reference_of(pairs: list[Any]) -> list[float] | None:
    """The precomputed reference log-probabilities of a micro-batch's rows (chosen, then rejected), or None."""
    if not pairs or not isinstance(pairs[0], Pair) or pairs[0].reference is None:
        return None
    return [p.reference[0] for p in pairs] + [p.reference[1] for p in pairs]


def rows_of(items: list[Any]) -> list[Example]:
    """The sequences of a micro-batch: examples as they are; pairs as their chosen, then their rejected."""
    if not items or not isinstance(items[0], Pair):
        return items
    return [p.chosen for p in items] + [p.rejected for p in items]


@dataclass
class PairSplit:
    """A split of pairs in memory, read by position like a split of examples."""

    pairs: list[Pair]
    skipped: list[str] = field(default_factory=list)
    reads: int = field(default=0, compare=False)  # pairs handed out by position (the loop's batches)
    reference: list[tuple[float, float]] | None = None  # per pair (`distft.train.reference`)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> Pair:
        self.reads += 1
        pair = self.pairs[i]
        return pair if self.reference is None else replace(pair, reference=self.reference[i])

    def label_count(self, i: int) -> float:
        """Labelled positions per sequence of pair `i` (the mean of its two answers')."""
        return sum(t != IGNORE for e in (self.pairs[i].chosen, self.pairs[i].rejected) for t in e.labels) / 2

    def summary(self) -> dict[str, float]:
        rows = [e for p in self.pairs for e in (p.chosen, p.rejected)]
        return split_summary(
            [len(e.input_ids) for e in rows], [e.truncated_tokens for e in rows], self.skipped
        )


def preference_splits(
    cfg: DataConfig, seed: int, tokenizer: Any, dataset: Any = None
) -> tuple[PairSplit, PairSplit]:
    """The train and validation pairs of a preference run."""
    formatter = ChatFormatter(tokenizer, cfg)
    splits = load_rows(cfg, seed, dataset)
    train, valid = (PairSplit(*encode_pairs(formatter, splits[name])) for name in ("train", "validation"))
    return train, valid


def training_splits(
    cfg: DataConfig, objective: str, seed: int, tokenizer: Any, dataset: Any = None, progress: Any = None
) -> tuple[Any, Any, dict]:
    """A run's train and validation splits and how they were had (`tokenized_splits`): examples
    for sft, pairs (in memory) for a preference objective."""
    if objective == "sft":
        return tokenized_splits(cfg, seed, tokenizer, dataset, progress=progress)
    start = time.perf_counter()
    train, valid = preference_splits(cfg, seed, tokenizer, dataset)
    check_splits(len(train), len(valid), data_name(cfg))
    return train, valid, {"state": "memory", "path": None, "seconds": round(time.perf_counter() - start, 3)}
