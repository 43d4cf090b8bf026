"""Every row format: detection, refusal of ambiguous and malformed rows, and label masks that
cover exactly the assistant's tokens."""

import copy

import pytest

from distft.config import DataConfig, load_config
from distft.data import (
    IGNORE,
    ChatFormatter,
    ChatRow,
    Message,
    SummaryRow,
    load_rows,
    prompt_and_reference,
    row_from_record,
)
from distft.errors import ConfigError, DataError
from tests.helpers import write_jsonl

CHAT = {
    "messages": [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Good morning"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "Thank you"},
        {"role": "assistant", "content": "Merci"},
    ]
}
PROMPT_COMPLETION = {"prompt": "Capital of France?", "completion": "Paris."}
ALPACA = {"instruction": "Translate to German.", "input": "Good night", "output": "Gute Nacht"}


def targets(tokenizer, example) -> list[str]:
    """The decoded runs of consecutive label tokens (one per assistant turn)."""
    runs, run = [], []
    for label in example.labels:
        if label == IGNORE and run:
            runs.append(tokenizer.decode(run))
            run = []
        elif label != IGNORE:
            run.append(label)
    return runs


def assert_shifted(example):
    assert len(example.input_ids) == len(example.labels) and example.labels[-1] == IGNORE
    for t, label in enumerate(example.labels):
        if label != IGNORE:
            assert label == example.input_ids[t + 1]


# ---- detection and parsing -----------------------------------------------------------------


def test_each_format_is_detected():
    chat = row_from_record(CHAT, DataConfig(), "x:1")
    assert isinstance(chat, ChatRow)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "user", "assistant"]
    pc = row_from_record(PROMPT_COMPLETION, DataConfig(), "x:2")
    assert pc.messages == (Message("user", ("Capital of France?",)), Message("assistant", ("Paris.",)))
    alpaca = row_from_record({"instruction": "Say hi.", "output": "Hi!"}, DataConfig(), "x:3")
    assert alpaca.messages == (Message("user", ("Say hi.",)), Message("assistant", ("Hi!",)))
    assert isinstance(
        row_from_record({"transcript": "A: hi", "summary": "Hi."}, DataConfig(), "x:4"), SummaryRow
    )


def test_an_ambiguous_row_is_refused_with_the_format_to_set(tmp_path):
    both = CHAT | PROMPT_COMPLETION
    path = write_jsonl(tmp_path / "both.jsonl", [both, both])
    with pytest.raises(DataError) as err:
        load_rows(DataConfig(source=str(path)))
    message = str(err.value)
    assert f"{path}:1" in message
    assert "completion, messages, prompt" in message  # the fields seen
    assert "chat and prompt_completion" in message  # the formats they fit
    assert "data.format=prompt_completion" in message


def test_data_format_forces_the_reading(tmp_path):
    path = write_jsonl(tmp_path / "alpaca.jsonl", [ALPACA, ALPACA, ALPACA])
    rows = load_rows(DataConfig(source=str(path), format="alpaca"))["train"]
    assert rows[0].messages[0] == Message("user", ("Translate to German.", "Good night"))
    # Forced to summary, the same fields read as qmsum-cleaned's transcript and summary.
    meeting = load_rows(DataConfig(source=str(path), format="summary"))["train"][0]
    assert (meeting.transcript, meeting.summary) == ("Good night", "Gute Nacht")
    with pytest.raises(DataError, match="missing field `completion`"):
        row_from_record(ALPACA | {"prompt": "p"}, DataConfig(format="prompt_completion"), "x:1")


def test_unknown_format_is_a_config_error():
    with pytest.raises(ConfigError, match=r"data\.format"):
        load_config(None, ["data.format=openai"])


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"messages": [{"role": "user", "content": "Hi"}]}, "no assistant turn"),
        (
            {"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]},
            "role 'tool'",
        ),
        (
            {"messages": [{"role": "user", "content": ["Hi"]}, {"role": "assistant", "content": "y"}]},
            "not text",
        ),
        ({"messages": [{"role": "user"}]}, "not a {role, content} object"),
        ({"messages": []}, "non-empty list"),
        ({"prompt": "Capital?"}, "missing field `completion`"),
        ({"prompt": "Capital?", "completion": 3}, "field `completion` is not text"),
        ({"instruction": "Say hi.", "output": " "}, "field `output` is empty"),
        ({"instruction": "Say hi."}, "missing field `output`"),
    ],
)
def test_malformed_rows_name_file_and_line(tmp_path, record, message):
    path = write_jsonl(tmp_path / "rows.jsonl", [PROMPT_COMPLETION, record, PROMPT_COMPLETION])
    with pytest.raises(DataError) as err:
        load_rows(DataConfig(source=str(path)))
    assert f"{path}:2" in str(err.value) and message in str(err.value)


def test_in_memory_datasets():
    cfg = DataConfig(validation_fraction=0.25)
    rows = [PROMPT_COMPLETION] * 8
    splits = load_rows(cfg, dataset=rows)
    assert (len(splits["train"]), len(splits["validation"])) == (6, 2)
    assert splits["train"][0].origin.startswith("dataset[")
    named = load_rows(
        cfg, dataset={"train": [CHAT] * 3, "validation": [{"instruction": "Say hi.", "output": "Hi!"}]}
    )
    assert len(named["train"]) == 3 and named["validation"][0].origin == "dataset[validation][0]"
    datasets = pytest.importorskip("datasets")
    from_hf = load_rows(cfg, dataset=datasets.Dataset.from_list([CHAT] * 4))
    assert from_hf["train"][0].messages == row_from_record(CHAT, cfg, "x").messages
    with pytest.raises(DataError, match=r"dataset\[1\]: missing field `completion`"):
        load_rows(cfg, dataset=[PROMPT_COMPLETION, {"prompt": "p"}])


# ---- label masks ---------------------------------------------------------------------------


def test_chat_labels_cover_every_assistant_turn_and_nothing_else(tokenizer):
    fmt = ChatFormatter(tokenizer, DataConfig())
    ex = fmt.encode(row_from_record(CHAT, DataConfig(), "x:1"))
    assert_shifted(ex)
    assert targets(tokenizer, ex) == ["Bonjour<|im_end|>", "Merci<|im_end|>"]
    text = tokenizer.decode(ex.input_ids)
    assert text == (
        "<|im_start|>system\nYou answer in French.<|im_end|>\n<|im_start|>user\nGood morning<|im_end|>\n"
        "<|im_start|>assistant\nBonjour<|im_end|>\n<|im_start|>user\nThank you<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nMerci<|im_end|>"
    )
    # Exactly the assistant tokens: their count is the tokens of both answers and two <|im_end|>.
    expected = len(tokenizer.encode("Bonjour")) + len(tokenizer.encode("Merci")) + 2
    assert sum(label != IGNORE for label in ex.labels) == expected


@pytest.mark.parametrize(
    ("record", "prompt_text", "answer"),
    [
        (PROMPT_COMPLETION, "<|im_start|>user\nCapital of France?<|im_end|>", "Paris."),
        (ALPACA, "<|im_start|>user\nTranslate to German.\n\nGood night<|im_end|>", "Gute Nacht"),
    ],
)
def test_single_turn_formats_label_the_answer(tokenizer, record, prompt_text, answer):
    cfg = DataConfig(format="alpaca" if "instruction" in record else "auto")
    ex = ChatFormatter(tokenizer, cfg).encode(row_from_record(record, cfg, "x:1"))
    assert_shifted(ex)
    assert targets(tokenizer, ex) == [f"{answer}<|im_end|>"]
    assert tokenizer.decode(ex.input_ids).startswith(prompt_text)  # no system prompt of ours


def test_enable_thinking_moves_the_think_block_from_prompt_to_target(tokenizer):
    row = row_from_record(PROMPT_COMPLETION, DataConfig(), "x:1")
    off = ChatFormatter(tokenizer, DataConfig(enable_thinking=False))
    on = ChatFormatter(tokenizer, DataConfig(enable_thinking=True))
    prompt = list(row.messages[:-1])
    assert tokenizer.decode(off.generation_ids(prompt)).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert tokenizer.decode(on.generation_ids(prompt)).endswith("<|im_start|>assistant\n")
    assert targets(tokenizer, off.encode(row)) == ["Paris.<|im_end|>"]
    assert targets(tokenizer, on.encode(row)) == ["<think>\n\n</think>\n\nParis.<|im_end|>"]
    # The same tokens either way: only where the loss falls differs.
    assert off.encode(row).input_ids == on.encode(row).input_ids
    meeting = tokenizer.decode(on.prompt_ids("A: hi"))
    assert meeting.endswith("A: hi<|im_end|>\n<|im_start|>assistant\n")


def test_the_models_own_template_is_used(tokenizer):
    plain = copy.deepcopy(tokenizer)  # a ChatML template without think blocks (Qwen2.5-like)
    plain.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    ex = ChatFormatter(plain, DataConfig()).encode(row_from_record(CHAT, DataConfig(), "x:1"))
    assert "<think>" not in plain.decode(ex.input_ids)
    assert targets(plain, ex) == ["Bonjour<|im_end|>", "Merci<|im_end|>"]


# ---- rows to generate for (`distft infer --input`, `distft eval`) ------------------------


def test_prompt_and_reference_split_at_the_last_assistant_turn():
    cfg = DataConfig()
    prompt, reference = prompt_and_reference(row_from_record(CHAT, cfg, "x:1"), cfg)
    assert [m.content for m in prompt] == ["You answer in French.", "Good morning", "Bonjour", "Thank you"]
    assert reference == "Merci"
    prompt, reference = prompt_and_reference(row_from_record(ALPACA, DataConfig(format="alpaca"), "x:1"), cfg)
    assert [(m.role, m.content) for m in prompt] == [("user", "Translate to German.\n\nGood night")]
    assert reference == "Gute Nacht"
    meeting = row_from_record({"transcript": "A: hi", "summary": "Hi."}, cfg, "x:1")
    prompt, reference = prompt_and_reference(meeting, cfg)
    assert prompt[-1].role == "user" and prompt[-1].parts[-1] == "A: hi" and reference == "Hi."


@pytest.mark.parametrize(
    ("record", "last_user"),
    [
        ({"messages": [*CHAT["messages"], {"role": "user", "content": "Goodbye"}]}, "Goodbye"),
        ({"messages": [{"role": "user", "content": "Hi"}]}, "Hi"),
        ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]}, "Hi"),
        ({"prompt": "Capital of Spain?"}, "Capital of Spain?"),
        ({"instruction": "Translate to German.", "input": "Good day"}, "Translate to German.\n\nGood day"),
    ],
)
def test_a_row_to_generate_for_may_lack_its_answer(record, last_user):
    """As a meeting may lack its summary: a chat may end with a user turn (or an empty answer),
    a prompt lack its completion, an instruction its output."""
    cfg = DataConfig()
    row = row_from_record(record, cfg, "x:1", need_answer=False)
    prompt, reference = prompt_and_reference(row, cfg)
    assert prompt[-1].role == "user" and prompt[-1].content == last_user and reference == ""
    try:  # training: the row is refused, or its turns after the last answer dropped
        assert prompt_and_reference(row_from_record(record, cfg, "x:1"), cfg)[1] == "Merci"
    except DataError as err:
        assert str(err).startswith("x:1: ")


def test_a_generation_prompt_is_cut_as_training_cuts(tokenizer):
    turns = []
    for i in range(12):
        turns += [
            {"role": "user", "content": f"Question {i}: " + "tell me more " * 10},
            {"role": "assistant", "content": f"Answer {i}."},
        ]
    turns.append({"role": "user", "content": "Question 12?"})
    cfg = DataConfig(max_length=200)
    row = row_from_record({"messages": turns}, cfg, "x:1", need_answer=False)
    formatter = ChatFormatter(tokenizer, cfg)
    full = formatter.generation_ids(list(row.messages), reserve=-10_000)  # room for everything
    ids, dropped = formatter.generation_prompt(list(row.messages), reserve=40)
    text = tokenizer.decode(ids)
    assert len(ids) <= 160 and dropped == len(full) - len(ids) > 0
    assert "Question 0:" not in text and text.endswith(
        "Question 12?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


# ---- truncation ----------------------------------------------------------------------------


def test_a_long_chat_drops_its_earliest_turns(tokenizer):
    turns = [{"role": "system", "content": "Be brief."}]
    for i in range(12):
        turns += [
            {"role": "user", "content": f"Question {i}: " + "tell me more " * 10},
            {"role": "assistant", "content": f"Answer {i}."},
        ]
    cfg = DataConfig(max_length=160)
    ex = ChatFormatter(tokenizer, cfg).encode(row_from_record({"messages": turns}, cfg, "x:1"))
    text = tokenizer.decode(ex.input_ids)
    assert len(ex.input_ids) <= 160 and ex.truncated_tokens > 0
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")  # the system turn stays
    assert "Question 0:" not in text and "Question 11:" in text
    assert targets(tokenizer, ex)[-1] == "Answer 11.<|im_end|>"


def test_alpaca_truncation_cuts_the_input_not_the_instruction(tokenizer):
    cfg = DataConfig(max_length=96, truncation="tail", format="alpaca")
    record = {
        "instruction": "Count the words.",
        "input": " ".join(f"w{i}" for i in range(200)),
        "output": "200",
    }
    ex = ChatFormatter(tokenizer, cfg).encode(row_from_record(record, cfg, "x:1"))
    text = tokenizer.decode(ex.input_ids)
    assert len(ex.input_ids) == 96 and ex.truncated_tokens > 0
    assert "Count the words." in text and "w199" in text and "w0 " not in text
    assert targets(tokenizer, ex) == ["200<|im_end|>"]


def test_an_answer_that_does_not_fit_is_refused(tokenizer):
    cfg = DataConfig(max_length=64)
    row = row_from_record({"prompt": "Write.", "completion": "word " * 80}, cfg, "rows.jsonl:9")
    with pytest.raises(DataError, match=r"rows.jsonl:9: the answer \(\d+ tokens\).*Raise data.max_length"):
        ChatFormatter(tokenizer, cfg).encode(row)
