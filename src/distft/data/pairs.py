"""Preference rows tokenised into pairs of examples: the chosen and the rejected conversation, each
through the chat template exactly as an SFT row is (`ChatFormatter`), then cut to their answers.

What the two share, token by token from the start, is the prompt: every label up to the first
token where they differ is dropped, so only the answers carry loss (a row with `prompt` shares at
least its turns; whole conversations every turn before their final answers, which
`distft.data.preference` checks). The two sequences of a pair always travel together: a batch of B
pairs is one micro-batch of 2B rows, the chosen ones first (`rows_of`), so both answers of a pair
meet in one forward on one rank.

KTO's rows are single answers (`Completion`), each labelled desirable or not, with a second
sequence: the same prompt followed by another row's answer (`mismatched`: the nearest earlier row
with another prompt, TRL's cycling of completions), which KTO's KL term scores. The answer's labels
are found as a pair's are, against a probe: the prompt followed by a one-character answer.

Pairs are tokenised in memory (the token cache holds single examples), before launch to name a bad
row by its origin, and again in each rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from distft.config import Config
from distft.config.choices import PAIRED, WITH_REFERENCE
from distft.config.preference import PreferenceConfig
from distft.data.cache import tokenized_splits
from distft.data.chat import IGNORE, ChatFormatter, Example, split_summary
from distft.data.formats import ChatRow
from distft.data.limits import limited_encoder, shared_tokens, within_limits
from distft.data.messages import Message
from distft.data.mixture import data_name
from distft.data.preference import PreferenceRow, UnpairedRow, unpaired
from distft.data.rows import check_splits, load_rows
from distft.data.template import check_chat_template
from distft.data.tokenizer import load_tokenizer, with_added_tokens
from distft.errors import DataError


@dataclass(frozen=True)
class Pair:
    chosen: Example
    rejected: Example
    reference: tuple[float, float] | None = None  # DPO's precomputed reference log-probabilities

    @property
    def sequences(self) -> tuple[Example, Example]:  # what the reference scores
        return self.chosen, self.rejected

    @property
    def rows(self) -> tuple[Example, ...]:  # what trains
        return self.chosen, self.rejected


@dataclass(frozen=True)
class Completion:
    """KTO's example: an answer, whether it is desirable, and its prompt with another row's answer."""

    example: Example
    mismatched: Example  # scored without gradients for KTO's KL term
    desirable: bool
    reference: tuple[float, float] | None = None  # precomputed: the answer's and the mismatched one's

    @property
    def sequences(self) -> tuple[Example, Example]:
        return self.example, self.mismatched

    @property
    def rows(self) -> tuple[Example, ...]:
        return (self.example,)


def labels_from(e: Example, first: int, origin: str, name: str) -> Example:
    """`e` with no label before position `first`; a DataError if none is left."""
    labels = [IGNORE] * first + e.labels[first:]
    if all(t == IGNORE for t in labels):
        raise DataError(
            f"{origin}: the {name} answer has no token of its own after the part both answers share "
            f"(the pair may have been cut to data.max_length)."
        )
    return Example(e.input_ids, labels, e.truncated_tokens)


def answers_only(chosen: Example, rejected: Example, origin: str) -> Pair:
    """The pair with the labels of the tokens both share from the start dropped."""
    first = shared_tokens(chosen, rejected)
    return Pair(
        labels_from(chosen, first, origin, "chosen"), labels_from(rejected, first, origin, "rejected")
    )


def encode_pairs(
    formatter: ChatFormatter, rows: list[PreferenceRow], limits: PreferenceConfig | None = None
) -> tuple[list[Pair], list[str]]:
    """Each preference row as a pair of examples (answers only), cut to `limits`
    (`within_limits`), and the origins of the rows skipped as too long (`data.skip_long_rows`)."""
    for row in rows:
        if not isinstance(row, PreferenceRow):
            raise DataError(
                f"{row.origin}: a preference objective (train.objective) trains on pairs of answers "
                "({prompt, chosen, rejected}, docs/preference.md), and this row is not one."
            )
    encoder, probes = limited_encoder(formatter, limits)
    chats = [
        ChatRow(m, r.origin)
        for r in rows
        for m in (r.chosen_messages, r.rejected_messages, _probe(unpaired(r)[0]))[: 3 if probes else 2]
    ]
    examples, per = encoder.encode_many(chats), 3 if probes else 2
    pairs, skipped = [], []
    for i, row in enumerate(rows):
        sequences = within_limits(examples[per * i : per * i + per], formatter.cfg, limits, row.origin)
        if sequences is None:
            skipped.append(row.origin)
        else:
            pairs.append(answers_only(*sequences[:2], row.origin))
    return pairs, skipped


def _probe(row: UnpairedRow) -> tuple[Message, ...]:
    """The row's prompt with a one-character answer that starts unlike its own."""
    text = "!" if row.completion[0].content.startswith("?") else "?"
    return (*row.prompt, Message("assistant", (text,)))


def mismatched_partners(rows: list[UnpairedRow]) -> list[int]:
    """For each row, the nearest earlier row (cyclically) whose prompt differs: its answer is the
    row's mismatched one (two rows of one pair share their prompt). The row before, if none does."""
    n = len(rows)
    return [
        next((j % n for j in range(i - 1, i - n, -1) if rows[j % n].prompt != rows[i].prompt), (i - 1) % n)
        for i in range(n)
    ]


def encode_completions(
    formatter: ChatFormatter, rows: list[Any], limits: PreferenceConfig | None = None
) -> tuple[list[Completion], list[str]]:
    """Each unpaired row (a pair: two, `unpaired`) as a `Completion`, labels on its answer only, cut
    to `limits` (`within_limits`), and the origins of the rows skipped as too long (`data.skip_long_rows`)."""
    unpaired_rows = []
    for row in rows:
        if isinstance(row, PreferenceRow):
            unpaired_rows += unpaired(row)
        elif isinstance(row, UnpairedRow):
            unpaired_rows.append(row)
        else:
            raise DataError(
                f"{row.origin}: train.objective=kto trains on answers labelled desirable or not "
                "({prompt, completion, label}) or on pairs (docs/preference.md), and this row is neither."
            )
    partners = mismatched_partners(unpaired_rows)
    chats = [
        ChatRow(messages, row.origin)
        for row, j in zip(unpaired_rows, partners, strict=True)
        for messages in (row.messages, row.prompt + unpaired_rows[j].completion, _probe(row))
    ]
    examples = limited_encoder(formatter, limits)[0].encode_many(chats)
    completions, skipped = [], []
    for i, row in enumerate(unpaired_rows):
        sequences = within_limits(examples[3 * i : 3 * i + 3], formatter.cfg, limits, row.origin)
        if sequences is None:
            skipped.append(row.origin)
            continue
        answer, mismatched, probe = sequences
        answer = labels_from(answer, shared_tokens(answer, probe), row.origin, "completion")
        mismatched = labels_from(mismatched, shared_tokens(mismatched, probe), row.origin, "mismatched")
        completions.append(Completion(answer, mismatched, row.desirable))
    return completions, skipped


def reference_of(items: list[Any]) -> list[float] | None:
    """The precomputed reference log-probabilities of a micro-batch's rows (`rows_of`), or None."""
    if not items or not isinstance(items[0], Pair | Completion) or items[0].reference is None:
        return None
    if isinstance(items[0], Completion):
        return [c.reference[0] for c in items]
    return [p.reference[0] for p in items] + [p.reference[1] for p in items]


def rows_of(items: list[Any]) -> list[Example]:
    """The rows a micro-batch trains: examples as they are; pairs as their chosen, then their
    rejected; KTO's completions as their answers."""
    if not items or not isinstance(items[0], Pair | Completion):
        return items
    return [e for k in range(len(items[0].rows)) for e in (item.rows[k] for item in items)]


def rows_per_item(objective: str) -> int:
    """Sequences a micro-batch item is: a pair's two (dpo, orpo), else one (an example, KTO's answer)."""
    return 2 if objective in PAIRED else 1


def blank_items(items: list[Any], count: int) -> list[Any]:
    """Examples, pairs or KTO's answers filled to `count` with blank ones, whose sequences carry no
    label and so count nothing (`PreferenceLoss`, the summed token loss): every rank runs whole
    micro-batches of a short batch (the last of a small validation split), a pair's two rows
    together, where a data-parallel rank's share would be empty or uneven and a pipeline's
    micro-batches have one shape."""
    if len(items) >= count or not items:
        return items
    blank = Example([0], [IGNORE], 0)
    if isinstance(items[0], Pair | Completion):
        reference = None if items[0].reference is None else (0.0, 0.0)
        is_pair = isinstance(items[0], Pair)
        fill = Pair(blank, blank, reference) if is_pair else Completion(blank, blank, False, reference)
    else:
        fill = blank
    return items + [fill] * (count - len(items))


def blank_preference(cfg: Any, rows: int) -> dict[str, torch.Tensor]:
    """What a micro-batch of `rows` rows carries beside its tokens under `cfg`'s objective, as
    zeros: for rows without a label (a pipeline's warm-up, whose stage shapes every step keeps)."""
    objective = cfg.train.objective
    blank: dict[str, torch.Tensor] = {}
    if objective in WITH_REFERENCE and cfg.dpo.precompute_reference:
        blank["reference"] = torch.zeros(rows)
    if objective == "orpo":
        blank["token_weight"] = torch.zeros(1)
    if objective == "kto":
        blank |= {"desirable": torch.zeros(rows, dtype=torch.bool), "kl": torch.zeros(1)}
    return blank


def desirable_of(items: list[Any]) -> list[bool] | None:
    """KTO: each answer's label; None for anything else."""
    return [c.desirable for c in items] if items and isinstance(items[0], Completion) else None


def micro_batch_part(items: list[Any], part: str = "train") -> tuple[list[Example], list[float] | None]:
    """The sequences of a micro-batch a forward runs, and their precomputed reference log-probabilities:
    "train" the rows it trains (`rows_of`); "score" every item's two sequences, first ones first
    (the reference scored before the first step); "kl" KTO's mismatched answers (its KL term)."""
    if part == "score":
        return [item.sequences[0] for item in items] + [item.sequences[1] for item in items], None
    if part == "kl":
        reference = [c.reference[1] for c in items] if items[0].reference is not None else None
        return [c.mismatched for c in items], reference
    return rows_of(items), reference_of(items)


@dataclass
class PairSplit:
    """A split of pairs (or KTO's completions) in memory, read by position like a split of examples."""

    pairs: list[Pair | Completion]
    skipped: list[str] = field(default_factory=list)
    reads: int = field(default=0, compare=False)  # pairs handed out by position (the loop's batches)
    reference: list[tuple[float, float]] | None = None  # per pair (`distft.train.reference`)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> Pair | Completion:
        self.reads += 1
        pair = self.pairs[i]
        return pair if self.reference is None else replace(pair, reference=self.reference[i])

    def label_count(self, i: int) -> float:
        """Labelled positions per row of item `i` (a pair: the mean of its two answers')."""
        rows = self.pairs[i].rows
        return sum(t != IGNORE for e in rows for t in e.labels) / len(rows)

    def summary(self) -> dict[str, float]:
        """`split_summary` of the sequences, counting a pair once: cut where either side is."""
        rows = [e for p in self.pairs for e in p.rows]
        summary = split_summary(
            [len(e.input_ids) for e in rows], [e.truncated_tokens for e in rows], self.skipped
        )
        cut = sum(any(e.truncated_tokens for e in p.rows) for p in self.pairs)
        return summary | {"rows": len(self.pairs), "truncated_rows": cut}


def preference_splits(cfg: Config, tokenizer: Any, dataset: Any = None) -> tuple[PairSplit, PairSplit]:
    """The train and validation pairs of a preference run (KTO: completions)."""
    formatter = ChatFormatter(tokenizer, cfg.data)
    splits = load_rows(cfg.data, cfg.train.seed, dataset)
    encode = encode_completions if cfg.train.objective == "kto" else encode_pairs
    train, valid = (PairSplit(*encode(formatter, splits[name], cfg.dpo)) for name in ("train", "validation"))
    return train, valid


def training_splits(
    cfg: Config, tokenizer: Any, dataset: Any = None, progress: Any = None
) -> tuple[Any, Any, dict]:
    """A run's train and validation splits and how they were had (`tokenized_splits`): examples
    for sft, pairs (in memory, so `[dpo]`'s limits need no place in the token cache's key) for a
    preference objective."""
    if cfg.train.objective == "sft":
        return tokenized_splits(cfg.data, cfg.train.seed, tokenizer, dataset, progress=progress)
    start = time.perf_counter()
    train, valid = preference_splits(cfg, tokenizer, dataset)
    check_splits(len(train), len(valid), data_name(cfg.data))
    return train, valid, {"state": "memory", "path": None, "seconds": round(time.perf_counter() - start, 3)}


def run_splits(
    cfg: Config, model: str | None, ranks: int | None = None, progress: Any = None
) -> tuple[Any, Any, dict]:
    """A run's train and validation splits (`training_splits`), tokenised with its model's tokenizer
    (`model`: a directory or hub id; None for a preset's bundled one, cut to `ranks` ranks where the
    preset says so) and added tokens, its chat
    template checked: what `distft train` reads before launch, and what `distft plan --config`
    measures the rows' labelled positions on."""
    tokenizer = with_added_tokens(
        load_tokenizer(model, cfg.model.revision, cfg.data.chat_template, ranks), cfg.model.added_tokens
    )
    check_chat_template(tokenizer, cfg.data)  # can the template close a turn, think?
    return training_splits(cfg, tokenizer, progress=progress)
