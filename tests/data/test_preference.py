"""Preference rows: each shape read and named, bad rows refused with their origin, the prompt
found token by token so that only the answers carry loss, and an SFT run reading them trains on
the chosen answer."""

from __future__ import annotations

import re

import pytest

from distft.config import DataConfig
from distft.config.preference import PreferenceConfig
from distft.data import ChatFormatter, load_rows, row_from_record
from distft.data.chat import IGNORE
from distft.data.formats import messages_of, prompt_and_reference, row_format
from distft.data.pairs import PairSplit, encode_completions, encode_pairs, rows_of
from distft.data.preference import PreferenceRow
from distft.errors import DataError
from tests.helpers import write_jsonl

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
        (
            {"prompt": "Q", "completion": "A", "label": "yes"},
            "pairs.jsonl:7: an unpaired row's `label` is true (a desirable answer) or false",
        ),
        ({"completion": "A", "label": True}, "pairs.jsonl:7: `completion` holds only the answer"),
    ],
    ids=["same answers", "no prompt", "empty answer", "bad role", "no answer", "label", "unpaired prompt"],
)
def test_a_bad_row_is_named_by_its_origin(record, says):
    with pytest.raises(DataError) as err:
        row_from_record(record, DataConfig(), "pairs.jsonl:7")
    assert says in str(err.value)


ANSWER = [{"role": "assistant", "content": "Anna."}]
MISSING = {  # a pairs or unpaired row that lacks a field, and the refusal naming it (any data.format)
    "prompt, chosen": ({"prompt": "Q", "chosen": "A"}, "missing field `rejected` (row has: chosen, prompt)"),
    "prompt, rejected": (
        {"prompt": "Q", "rejected": "B"},
        "missing field `chosen` (row has: prompt, rejected)",
    ),
    "conversation": ({"chosen": [*TURNS, *ANSWER]}, "missing field `rejected` (row has: chosen)"),
    "null": ({"prompt": "Q", "chosen": "A", "rejected": None}, "missing field `rejected` (it is null)"),
    "meeting": (
        {"transcript": "A: hi", "chosen": "Hi."},
        "missing field `rejected` (row has: chosen, transcript)",
    ),
    "no completion": ({"prompt": "Q", "label": True}, "missing field `completion` (row has: label, prompt)"),
    "no label": ({"transcript": "A: hi", "completion": "Hi."}, "missing field `label`"),
}


@pytest.mark.parametrize("case", MISSING)
@pytest.mark.parametrize("fmt", ["auto", "declared"])
def test_a_row_missing_a_field_is_refused_naming_that_field_for_its_format(case, fmt):
    """Not the field another format would need: `{prompt, chosen}` once read as a prompt_completion
    row without its completion. Under auto the row is read as the format whose own fields it has
    (`chosen`, `rejected`, `label`), however many fields it shares with others (`prompt`)."""
    record, says = MISSING[case]
    declared = "unpaired" if "completion" in says or "label" in says else "preference"
    cfg = DataConfig(format=declared if fmt == "declared" else "auto")
    with pytest.raises(DataError) as err:
        row_from_record(record, cfg, "pairs.jsonl:3")
    assert str(err.value).startswith(f"pairs.jsonl:3: {says}")
    kind = (
        "an unpaired row needs `completion` and `label`" if declared == "unpaired" else "needs `chosen` and"
    )
    assert kind in str(err.value)


def test_a_pair_missing_its_rejected_answer_is_named_by_file_and_line(tmp_path):
    rows = [{"prompt": f"Q{i}", "chosen": "A", "rejected": "B"} for i in range(2)] + [
        {"prompt": "Q", "chosen": "A"}
    ]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(
        DataError, match=rf"^{re.escape(str(data))}:3: missing field `rejected` \(row has: chosen"
    ):
        load_rows(DataConfig(source=str(data)), seed=0)


def turns(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in pairs]


ASKED = (("user", "Who owns the budget?"),)
DIFFERENT = {  # whole conversations whose turns before the final answers differ, and what is said
    "user turn": (
        turns(*ASKED, ("assistant", "Anna.")),
        turns(("user", "Who owns the plan?"), ("assistant", "Bob.")),
        "turn 0 differs: user 'Who owns the budget?' in `chosen`, user 'Who owns the plan?' in `rejected`.",
    ),
    "system turn": (
        turns(("system", "Be brief."), *ASKED, ("assistant", "Anna.")),
        turns(("system", "Be wordy."), *ASKED, ("assistant", "Bob.")),
        "turn 0 differs: system 'Be brief.' in `chosen`, system 'Be wordy.' in `rejected`.",
    ),
    "earlier answer": (
        turns(*ASKED, ("assistant", "Anna."), ("user", "When?"), ("assistant", "Friday.")),
        turns(*ASKED, ("assistant", "Bob."), ("user", "When?"), ("assistant", "Monday.")),
        "turn 1 differs: assistant 'Anna.' in `chosen`, assistant 'Bob.' in `rejected`.",
    ),
    "a turn more": (
        turns(*ASKED, ("assistant", "Anna.")),
        turns(*ASKED, ("assistant", "Anna."), ("user", "And?"), ("assistant", "Bob.")),
        "`chosen` has 1 turn before it, `rejected` 3 turns.",
    ),
    "rejected without the prompt": (
        turns(*ASKED, ("assistant", "Anna.")),
        "Bob.",
        "`chosen` has 1 turn before it, `rejected` 0 turns.",
    ),
}


@pytest.mark.parametrize("case", DIFFERENT)
def test_whole_conversations_that_differ_before_their_final_answers_are_refused(case, tokenizer):
    """The prompt of whole conversations is what the two share; a turn before the final answer that
    differs would end it early, and the rest of the rejected side (a user turn that asks something
    else) would be compared as its answer. Refused before launch, with file and line."""
    chosen, rejected, says = DIFFERENT[case]
    record = {"prompt": "Who owns the budget?", "chosen": chosen, "rejected": rejected}
    with pytest.raises(DataError) as err:
        row_from_record(record, DataConfig(), "hh.jsonl:4")
    assert str(err.value) == (
        "hh.jsonl:4: `chosen` and `rejected` must share every turn before the final assistant answer "
        f"(the prompt), and {says}"
    )
    # Answers of several turns after an explicit prompt stay a pair: the prompt is given, not found.
    answers_only = {"prompt": "Q", "chosen": turns(("assistant", "A"), ("user", "B?"), ("assistant", "C")),
                    "rejected": turns(("assistant", "D"))}  # fmt: skip
    assert isinstance(row_from_record(answers_only, DataConfig(), "p.jsonl:1"), PreferenceRow)


def test_unpaired_rows_and_pairs_are_kto_answers_each_with_a_mismatched_one_of_another_prompt(tokenizer):
    """KTO's rows: {prompt, completion, label} (not prompt_completion, for its label), or a pair as
    two; loss on each answer alone; each answer's KL sequence is its prompt with the answer of the
    nearest earlier row that asks something else (cyclically)."""
    cfg = DataConfig()
    good = row_from_record(
        {"prompt": "Who owns the budget?", "completion": "Anna, by Friday.", "label": True}, cfg, "u.jsonl:1"
    )
    bad = row_from_record(
        {"transcript": "Anna: I own it.", "completion": "Bob.", "label": False}, cfg, "u.jsonl:2"
    )
    assert row_format(good) == "unpaired" and good.desirable and not bad.desirable
    assert messages_of(good, cfg)[-1].content == "Anna, by Friday."  # SFT: a desirable answer is a chat
    with pytest.raises(DataError, match=r"u\.jsonl:2: an undesirable answer \(label false\)"):
        messages_of(bad, cfg)  # ... an undesirable one is refused, named
    assert prompt_and_reference(bad, cfg) == (bad.prompt, "")  # eval has no answer to compare with
    pair = row_from_record(SHAPES["conversations"], cfg, "p.jsonl:1")  # the same prompt as `good`
    completions, skipped = encode_completions(ChatFormatter(tokenizer, cfg), [good, bad, pair])
    assert skipped == [] and [c.desirable for c in completions] == [True, False, True, False]
    said = ["Anna, by Friday.", "Bob.", "Anna, by Friday.", "Bob, by Monday."]
    assert [answers(tokenizer, c.example) for c in completions] == [f"{a}<|im_end|>" for a in said]
    # Partners: rows 0, 2 and 3 share a prompt, so each takes row 1's answer, and row 1 row 0's.
    assert [answers(tokenizer, c.mismatched) for c in completions] == [
        f"{said[j]}<|im_end|>" for j in (1, 0, 1, 1)
    ]
    meeting = tokenizer.decode(completions[1].mismatched.input_ids)
    assert "Anna: I own it." in meeting and "Anna, by Friday." in meeting  # its prompt, another's answer
    assert rows_of(completions[:2]) == [completions[0].example, completions[1].example]


def test_a_split_of_pairs_counts_each_pair_once(tokenizer):
    """The run's header says pairs, not their sequences: a pair is cut if either answer is."""
    rows = [row_from_record(SHAPES[shape], DataConfig(), f"p.jsonl:{i}") for i, shape in enumerate(SHAPES)]
    formatter = ChatFormatter(tokenizer, DataConfig())
    summary = PairSplit(encode_pairs(formatter, rows)[0]).summary()
    assert summary["rows"] == 3 and summary["truncated_rows"] == 0
    cut = encode_pairs(formatter, rows, PreferenceConfig(max_completion_length=2))[0]
    assert PairSplit(cut).summary()["truncated_rows"] == 3


def test_a_preference_objective_refuses_rows_that_are_not_pairs(tokenizer):
    chat = row_from_record(
        {"messages": [*TURNS, {"role": "assistant", "content": "Anna."}]}, DataConfig(), "c.jsonl:2"
    )
    with pytest.raises(DataError, match=r"c\.jsonl:2: a preference objective"):
        encode_pairs(ChatFormatter(tokenizer, DataConfig()), [chat])


def test_the_bundled_meetings_as_pairs_reject_a_detail_the_meeting_never_had(tokenizer):
    """`sample-pairs`: the bundled meetings, in order, three pairs each; chosen is the true summary,
    rejected the same with its day, a decision or an owner replaced by one nobody said; the prompt is
    the summary row's (system prompt, instruction, transcript), so a model trained on `sample` is
    asked exactly what it learnt to answer."""
    cfg = DataConfig(source="sample-pairs", max_rows=12)
    pairs, meetings = load_rows(cfg, seed=0)["train"], load_rows(DataConfig(max_rows=4), seed=0)["train"]
    kinds = []
    for pair, meeting in zip(pairs, [m for m in meetings for _ in range(3)], strict=True):
        assert pair.chosen[-1].content == meeting.summary
        assert messages_of(pair, cfg) == messages_of(meeting, DataConfig())  # SFT on pairs: the same rows
        chosen, rejected = pair.chosen[-1].content, pair.rejected[-1].content
        start = next(i for i, (a, b) in enumerate(zip(chosen, rejected, strict=False)) if a != b)
        start = chosen.rindex(" ", 0, start) + 1  # the detail's first word
        end = next(i for i in range(1, len(chosen)) if chosen[-i:] != rejected[-i:]) - 1
        while end and chosen[-end].isalnum():  # the detail's last word, whole
            end -= 1
        said, wrong = chosen[start : len(chosen) - end], rejected[start : len(rejected) - end]
        assert said in meeting.transcript and not re.search(rf"\b{re.escape(wrong)}\b", meeting.transcript)
        after = start > chosen.index(". ", chosen.index("agreed on"))  # an action item's
        kinds.append(("day" if chosen[:start].endswith(" by ") else "owner") if after else "decision")
    assert kinds == ["day", "decision", "owner"] * 4  # each meeting, each kind of detail
    row = row_from_record({"transcript": "A: hi.", "chosen": "Hi.", "rejected": "Bye."}, DataConfig(), "m:1")
    (pair,), _ = encode_pairs(ChatFormatter(tokenizer, DataConfig()), [row])
    assert answers(tokenizer, pair.chosen) == "Hi.<|im_end|>"
