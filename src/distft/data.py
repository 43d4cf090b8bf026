"""Meeting transcripts -> chat-formatted, label-masked token tensors, in a deterministic order.

Rows come from the bundled sample meetings, a local JSONL/Parquet file, or a hub dataset; the
known AMI schemas are recognised (knkarthick/AMI `{dialogue, summary}`, QMSum
`{meeting_transcripts, general_query_list}`, qmsum-cleaned `{input, output}`, ours
`{transcript, summary}`), other field names are configurable.

Each row becomes one Qwen3 chat: [system], user = instruction + transcript, assistant = summary.
Only the summary tokens (and the closing `<|im_end|>`) carry loss. Real AMI transcripts run ~10k
tokens (p90 ~15k), so a transcript that does not fit `max_length` is cut by `data.truncation`
(head / tail / middle); the summary is never cut.

Labels are stored already shifted (labels[t] is the token position t predicts), so strategies
that split the sequence (SP) or the layer stack (PP) need no shift of their own.

Batches: the rows of optimizer step `s` are a fixed function of (seed, s, global batch size), so
every strategy and process count trains on exactly the same global batch. A data-parallel rank
takes its contiguous slice of it (`rank_micro_batches`).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distft.config import DataConfig
from distft.errors import DataError

IGNORE = -100
MIN_TRANSCRIPT_TOKENS = 32  # below this a "summary" of the transcript is meaningless
_PLACEHOLDER = "\x00TRANSCRIPT\x00"


@dataclass(frozen=True)
class MeetingRow:
    transcript: str
    summary: str
    origin: str  # "file.jsonl:12" or "dataset[split][7]": where to look when something is wrong


# ---------------------------------------------------------------------------------------------
# Reading rows
# ---------------------------------------------------------------------------------------------

# (transcript field, summary field) of the schemas recognised without configuration.
KNOWN_SCHEMAS: list[tuple[str, str]] = [
    ("transcript", "summary"),  # distft sample meetings
    ("dialogue", "summary"),  # knkarthick/AMI
    ("input", "output"),  # pszemraj/qmsum-cleaned
    ("meeting_transcripts", "general_query_list"),  # QMSum raw
]


def _text_of(value: Any, field: str) -> str:
    """Flatten QMSum's structured fields; plain strings pass through."""
    if isinstance(value, str):
        return value
    if field == "meeting_transcripts" and isinstance(value, list):
        return "\n".join(f"{turn['speaker']}: {turn['content']}" for turn in value)
    if field == "general_query_list" and isinstance(value, list):
        # The whole-meeting summary is the general query "Summarize the whole meeting."
        for query in value:
            if "whole meeting" in query.get("query", "").lower():
                return query["answer"]
        return value[0]["answer"] if value else ""
    raise TypeError(f"unsupported value of type {type(value).__name__}")


def row_from_record(record: dict[str, Any], cfg: DataConfig, origin: str) -> MeetingRow:
    if not isinstance(record, dict):
        raise DataError(f"{origin}: expected a JSON object, got {type(record).__name__}.")
    if cfg.transcript_field or cfg.summary_field:
        fields = (cfg.transcript_field or "transcript", cfg.summary_field or "summary")
    else:
        fields = next((s for s in KNOWN_SCHEMAS if s[0] in record and s[1] in record), None)
        # A known schema with one of its two fields present: report the other one as missing.
        fields = fields or next((s for s in KNOWN_SCHEMAS if s[0] in record or s[1] in record), None)
        if fields is None:
            known = "; ".join(f"{{{t}, {s}}}" for t, s in KNOWN_SCHEMAS)
            raise DataError(
                f"{origin}: no transcript/summary fields found (row has: {', '.join(sorted(record))}). "
                f"Known schemas: {known}. Name yours with data.transcript_field=... data.summary_field=..."
            )
    texts = []
    for field in fields:
        if field not in record:
            raise DataError(f"{origin}: missing field `{field}` (row has: {', '.join(sorted(record))}).")
        try:
            text = _text_of(record[field], field).strip()
        except (TypeError, KeyError) as err:
            raise DataError(f"{origin}: field `{field}` is not text ({err}).") from None
        if not text:
            raise DataError(f"{origin}: field `{field}` is empty.")
        texts.append(text)
    return MeetingRow(texts[0], texts[1], origin)


def _read_jsonl(path: Path, cfg: DataConfig) -> list[MeetingRow]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{path}:{line_no}: not valid JSON ({err.msg} at column {err.colno})."
                ) from None
            rows.append(row_from_record(record, cfg, f"{path}:{line_no}"))
    return rows


def _read_parquet(path: Path, cfg: DataConfig) -> list[MeetingRow]:
    import pyarrow.parquet as pq

    table = pq.read_table(path).to_pylist()
    return [row_from_record(r, cfg, f"{path}[row {i}]") for i, r in enumerate(table)]


def _read_hub(dataset_id: str, split: str, cfg: DataConfig) -> list[MeetingRow]:
    import datasets

    try:
        ds = datasets.load_dataset(dataset_id, split=split)
    except Exception as err:
        raise DataError(
            f"Could not load dataset {dataset_id!r} split {split!r} ({str(err).splitlines()[0]}). "
            "Offline, or for a gated set, download it elsewhere and pass the .jsonl/.parquet file with --data."
        ) from None
    return [row_from_record(r, cfg, f"{dataset_id}[{split}][{i}]") for i, r in enumerate(ds)]


def _split_off(rows: list[MeetingRow], fraction: float, seed: int) -> dict[str, list[MeetingRow]]:
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = max(1, round(len(rows) * fraction))
    return {"validation": [rows[i] for i in order[:n_val]], "train": [rows[i] for i in order[n_val:]]}


def load_rows(cfg: DataConfig, seed: int = 0) -> dict[str, list[MeetingRow]]:
    """{"train": rows, "validation": rows} from `cfg.source`."""
    if cfg.source == "sample":
        from distft.sample import sample_path

        splits = {name: _read_jsonl(sample_path(name), cfg) for name in ("train", "validation")}
    elif cfg.source.endswith((".jsonl", ".json", ".parquet")):
        path = Path(cfg.source)
        if not path.is_file():
            raise DataError(f"Dataset file {path} does not exist.")
        reader = _read_parquet if path.suffix == ".parquet" else _read_jsonl
        rows = reader(path, cfg)
        if len(rows) < 2:
            raise DataError(
                f"Dataset file {path} has {len(rows)} row(s); training needs at least 2 (one is held out "
                "for validation), each a JSON object with a transcript and a summary."
            )
        splits = _split_off(rows, cfg.validation_fraction, seed)
    elif Path(cfg.source).exists():
        raise DataError(f"{cfg.source}: a local dataset must be a .jsonl or .parquet file.")
    else:
        train = _read_hub(cfg.source, cfg.train_split, cfg)
        try:
            splits = {"train": train, "validation": _read_hub(cfg.source, cfg.validation_split, cfg)}
        except DataError:
            splits = _split_off(train, cfg.validation_fraction, seed)
    if cfg.max_rows:
        splits["train"] = splits["train"][: cfg.max_rows]
    if not splits["train"]:
        raise DataError(f"Dataset {cfg.source} has no training rows.")
    if not splits["validation"]:
        raise DataError(f"Dataset {cfg.source} has no validation rows.")
    return splits


# ---------------------------------------------------------------------------------------------
# Rows -> tokens
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------


def global_batch_indices(step: int, n_rows: int, global_batch_size: int, seed: int) -> list[int]:
    """Rows of optimizer step `step`: a stream of seeded per-epoch permutations, cut in batches."""
    start = step * global_batch_size
    indices: list[int] = []
    while len(indices) < global_batch_size:
        epoch, offset = divmod(start + len(indices), n_rows)
        perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        indices.extend(perm[offset : offset + global_batch_size - len(indices)].tolist())
    return indices


def collate(examples: list[Example], pad_id: int, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example (or `pad_to`); padding has attention 0 and no loss."""
    length = pad_to or max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        attention_mask[i, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def count_label_tokens(examples: list[Example]) -> int:
    return sum(sum(1 for t in e.labels if t != IGNORE) for e in examples)


def rank_micro_batches(
    examples: list[Example], dp_rank: int, dp_size: int, micro_batch_size: int
) -> list[list[Example]]:
    """This data-parallel rank's contiguous slice of a global batch, cut into micro-batches."""
    per_rank = len(examples) // dp_size
    mine = examples[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
