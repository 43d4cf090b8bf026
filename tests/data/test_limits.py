"""`dpo.max_prompt_length` and `dpo.max_completion_length` (`distft.data.limits`): a pair keeps its
prompt's last tokens and each answer's first, as TRL's DPOConfig does, before data.max_length."""

from __future__ import annotations

import pytest

from distft.config import DataConfig
from distft.config.preference import PreferenceConfig
from distft.data import ChatFormatter, row_from_record
from distft.data.chat import IGNORE, Example
from distft.data.pairs import encode_completions, encode_pairs
from distft.errors import DataError

RECORD = {
    "prompt": "Meeting notes: Anna said she will draft the budget by Friday, and Bob will review it on "
    "Monday after the call with the vendor about the remote control design. Who drafts the budget?",
    "chosen": "Anna drafts the budget, by Friday, and Bob reviews it on Monday.",
    "rejected": "Bob drafts the budget, by Monday, and Anna reviews it on Friday.",
}
LIMITS = PreferenceConfig(max_prompt_length=12, max_completion_length=5)


def parts(e: Example) -> tuple[list[int], list[int]]:
    """An uncut example's prompt and answer tokens: the answer starts at the first token a label predicts."""
    start = next(t for t, label in enumerate(e.labels) if label != IGNORE) + 1
    return e.input_ids[:start], e.input_ids[start:]


def trained(e: Example) -> list[int]:
    return [t for t in e.labels if t != IGNORE]


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_the_prompt_keeps_its_end_and_each_answer_its_start(objective, tokenizer):
    row = row_from_record(RECORD, DataConfig(), "p.jsonl:1")
    formatter = ChatFormatter(tokenizer, DataConfig())
    if objective == "dpo":
        ((whole,), _), ((cut,), _) = (encode_pairs(formatter, [row], limits) for limits in (None, LIMITS))
        sides = [(whole.chosen, cut.chosen), (whole.rejected, cut.rejected)]
    else:  # KTO: each answer, and the mismatched one (the other answer, the same prompt)
        whole, cut = (encode_completions(formatter, [row], limits)[0] for limits in (None, LIMITS))
        sides = [(w.example, c.example) for w, c in zip(whole, cut, strict=True)]
        sides += [(w.mismatched, c.mismatched) for w, c in zip(whole, cut, strict=True)]
    for full, short in sides:
        prompt, answer = parts(full)
        assert short.input_ids == prompt[-12:] + answer[:5]
        assert trained(short) == answer[:5] == trained(full)[:5]  # the loss on the answer alone
        assert short.truncated_tokens == len(full.input_ids) - 17


def test_data_max_length_then_cuts_more_of_the_prompt_or_refuses_the_row(tokenizer):
    row = row_from_record(RECORD, DataConfig(), "p.jsonl:4")
    (whole,), _ = encode_pairs(ChatFormatter(tokenizer, DataConfig()), [row])
    answers = PreferenceConfig(max_completion_length=5)
    (pair,), _ = encode_pairs(ChatFormatter(tokenizer, DataConfig(max_length=40)), [row], answers)
    prompt, answer = parts(whole.chosen)
    assert pair.chosen.input_ids == prompt[-35:] + answer[:5]  # within data.max_length, its end kept
    tight = ChatFormatter(tokenizer, DataConfig(max_length=36))  # 31 tokens left for the prompt
    with pytest.raises(DataError) as err:
        encode_pairs(tight, [row], answers)
    assert str(err.value) == (
        "p.jsonl:4: the longest answer (5 tokens, dpo.max_completion_length=5) leaves 31 of "
        "data.max_length=36 tokens for the prompt (at least 32 needed). Raise data.max_length, lower "
        "dpo.max_completion_length, or skip such rows with data.skip_long_rows=true."
    )
    skipping = ChatFormatter(tokenizer, DataConfig(max_length=36, skip_long_rows=True))
    assert encode_pairs(skipping, [row], answers) == ([], ["p.jsonl:4"])
