"""Preference rows: each shape read and named, bad rows refused with their origin, the prompt
found token by token so that only the answers carry loss, and an SFT run reading them trains on
the chosen answer."""

from __future__ import annotations

import re

import pytest

from distft.config import DataConfig
from distft.data import ChatFormatter, load_rows, row_from_record
from distft.data.chat import IGNORE
from distft.data.formats import messages_of, row_format
from distft.data.pairs import encode_pairs, rows_of
from distft.data.preference import PreferenceRow
from distft.errors import DataError

TURNS = [{"role": "user", "content": "Who owns the budget?"}]
ACTION = r"(\w+) will (.+?) by ([^.]+)\."  # an action item of a sample summary
SHAPES = {
    "strings": {
        "prompt": "Who owns the budget?",
        "chosen": "Anna, by Friday.",
        "rejected": "Bob, by Monday.",
    },
    "answer turns": {
        "prompt": TURNS,
        "chosen": [{"role": "assistant", "content": "Anna, by Friday."}],
        "rejected": [{"role": "assistant", "content": "Bob, by Monday."}],
    },
    "conversations": {  # UltraFeedback-binarized: the prompt repeated inside each conversation
        "prompt": "Who owns the budget?",
        "chosen": [*TURNS, {"role": "assistant", "content": "Anna, by Friday."}],
        "rejected": [*TURNS, {"role": "assistant", "content": "Bob, by Monday."}],
    },
}


def answers(tokenizer, example) -> str:
    return tokenizer.decode([t for t in example.labels if t != IGNORE])


@pytest.mark.parametrize("shape", SHAPES)
def test_every_shape_is_one_pair_whose_answers_alone_carry_loss(shape, tokenizer):
    row = row_from_record(SHAPES[shape], DataConfig(), "pairs.jsonl:3")
    assert isinstance(row, PreferenceRow) and row_format(row) == "preference"
    assert row.chosen_messages[0].content == "Who owns the budget?"
    # Read by an SFT run: the chosen conversation.
    assert [m.content for m in messages_of(row, DataConfig())][-1] == "Anna, by Friday."
    (pair,), skipped = encode_pairs(ChatFormatter(tokenizer, DataConfig()), [row])
    assert skipped == []
    # Everything up to the first token that differs is the shared prompt: only the answers remain.
    assert answers(tokenizer, pair.chosen) == "Anna, by Friday.<|im_end|>"
    assert answers(tokenizer, pair.rejected) == "Bob, by Monday.<|im_end|>"
    assert rows_of([pair, pair]) == [pair.chosen, pair.chosen, pair.rejected, pair.rejected]


def test_whole_conversations_share_a_multi_turn_prompt_found_token_by_token(tokenizer):
    """HH-RLHF's shape: earlier turns in both conversations; the loss is on the last answer only."""
    earlier = [*TURNS, {"role": "assistant", "content": "Anna."}, {"role": "user", "content": "By when?"}]
    row = row_from_record(
        {"chosen": [*earlier, {"role": "assistant", "content": "Friday."}],
         "rejected": [*earlier, {"role": "assistant", "content": "Never."}]},
        DataConfig(), "hh.jsonl:1",
    )  # fmt: skip
    assert row.prompt == ()
    (pair,), _ = encode_pairs(ChatFormatter(tokenizer, DataConfig()), [row])
    assert answers(tokenizer, pair.chosen) == "Friday.<|im_end|>"  # not "Anna." of the earlier turn
    assert answers(tokenizer, pair.rejected) == "Never.<|im_end|>"


@pytest.mark.parametrize(
    ("record", "says"),
    [
        (
            {"prompt": "Q", "chosen": "A", "rejected": "A"},
            "pairs.jsonl:7: `chosen` and `rejected` are the same answer",
        ),
        (
            {"chosen": "A", "rejected": "B"},
            "pairs.jsonl:7: `chosen` holds only the answer, and the row has no `prompt`",
        ),
        ({"prompt": "Q", "chosen": "", "rejected": "B"}, "pairs.jsonl:7: `chosen` is empty"),
        (
            {"prompt": "Q", "chosen": "A", "rejected": [{"role": "robot", "content": "B"}]},
            "rejected message 0 has role 'robot'",
        ),
        ({"chosen": TURNS, "rejected": TURNS}, "`chosen` must end with a non-empty assistant turn"),
    ],
    ids=["same answers", "no prompt", "empty answer", "bad role", "no answer"],
)
def test_a_bad_row_is_named_by_its_origin(record, says):
    with pytest.raises(DataError) as err:
        row_from_record(record, DataConfig(), "pairs.jsonl:7")
    assert says in str(err.value)


def test_a_preference_objective_refuses_rows_that_are_not_pairs(tokenizer):
    chat = row_from_record(
        {"messages": [*TURNS, {"role": "assistant", "content": "Anna."}]}, DataConfig(), "c.jsonl:2"
    )
    with pytest.raises(DataError, match=r"c\.jsonl:2: a preference objective"):
        encode_pairs(ChatFormatter(tokenizer, DataConfig()), [chat])


def test_the_bundled_meetings_as_pairs_swap_the_action_owners_and_ask_as_a_summary_row_does(tokenizer):
    """`sample-pairs`: the bundled meetings, in order; chosen is the true summary, rejected the same
    with its two action owners swapped; the prompt is the summary row's (system prompt, instruction,
    transcript), so a model trained on `sample` is asked exactly what it learnt to answer."""
    cfg = DataConfig(source="sample-pairs", max_rows=4)
    pairs, meetings = load_rows(cfg, seed=0)["train"], load_rows(DataConfig(max_rows=4), seed=0)["train"]
    for pair, meeting in zip(pairs, meetings, strict=True):
        assert pair.chosen[-1].content == meeting.summary
        assert messages_of(pair, cfg) == messages_of(meeting, DataConfig())  # SFT on pairs: the same rows
        chosen, rejected = pair.chosen[-1].content, pair.rejected[-1].content
        (a, task_a, day_a), (b, task_b, day_b) = re.findall(ACTION, chosen)
        assert a != b and re.findall(ACTION, rejected) == [(b, task_a, day_a), (a, task_b, day_b)]
        assert (
            rejected[: rejected.index(f"{b} will")] == chosen[: chosen.index(f"{a} will")]
        )  # decisions kept
    row = row_from_record({"transcript": "A: hi.", "chosen": "Hi.", "rejected": "Bye."}, DataConfig(), "m:1")
    (pair,), _ = encode_pairs(ChatFormatter(tokenizer, DataConfig()), [row])
    assert answers(tokenizer, pair.chosen) == "Hi.<|im_end|>"
