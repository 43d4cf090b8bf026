"""A real checkpoint's own tokenizer and chat template: the end-of-turn token read from the
template, label masks that cover exactly each answer and its end-of-turn token, the ids a server
gets tokenising the rendered text whole, and the refusals before launch. Tokenizer-only (no model), on Llama 3 and Mistral templates over the
bundled vocabulary (`tests.chat_templates`)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from distft.config import DataConfig
from distft.data import ChatFormatter, check_chat_template, load_tokenizer, row_from_record
from distft.data.formats import ChatRow, Message, SummaryRow, messages_of
from distft.errors import ConfigError
from tests.chat_templates import tokenizer_dir
from tests.data.test_formats import ALPACA, PROMPT_COMPLETION, assert_shifted, targets

CHAT = ChatRow(
    (
        Message("user", ("Where is the remote?",)),
        Message("assistant", ("On the table.",)),
        Message("user", ("And the budget?",)),
        Message("assistant", ("Ten euros, fixed.",)),
    ),
    "chat.jsonl:1",
)
END = {"llama3": "<|eot_id|>", "mistral": "</s>"}


@pytest.fixture(scope="module")
def family_tokenizers(tmp_path_factory):
    """Each style's tokenizer, as distft loads a model directory's."""
    root = tmp_path_factory.mktemp("tokenizers")
    return {style: load_tokenizer(str(tokenizer_dir(style, root / style))) for style in END}


@pytest.mark.parametrize("style", ["llama3", "mistral"])
def test_labels_are_each_answer_and_its_end_of_turn(family_tokenizers, style):
    tokenizer = family_tokenizers[style]
    formatter = ChatFormatter(tokenizer, DataConfig(system_prompt="", max_length=512))
    assert formatter.end.token == END[style] == tokenizer.eos_token
    assert formatter.end_id == tokenizer.convert_tokens_to_ids(END[style])
    example = formatter.encode(CHAT)
    assert_shifted(example)
    end = END[style]
    assert targets(tokenizer, example) == [f"On the table.{end}", f"Ten euros, fixed.{end}"]
    # The tokens are the template's rendering of the chat, nothing added or lost.
    chat = [{"role": m.role, "content": m.content} for m in CHAT.messages]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    assert tokenizer.decode(example.input_ids) == rendered
    prompt = tokenizer.apply_chat_template(chat[:3], tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(formatter.generation_ids(list(CHAT.messages[:3]))) == prompt


RECORDS = {  # a meeting's instruction ends in "." before the transcript, as alpaca's before its input
    "meeting": {
        "transcript": "Anna: we ship on Friday.\n\nBob: fine. The budget?",
        "summary": "Ships Friday.",
    },
    "chat": {
        "messages": [
            {"role": "user", "content": "Where is it?\n\nThe remote."},
            {"role": "assistant", "content": "On the table."},
            {"role": "user", "content": "And the budget?"},
            {"role": "assistant", "content": "Ten euros."},
        ]
    },
    "prompt_completion": PROMPT_COMPLETION,
    "alpaca": ALPACA,
}
# Every tiny preset (micro, llama-micro, qwen2-micro, mistral-micro) renders with the bundled Qwen3
# tokenizer and template, thinking off or on; a model directory brings its own (Llama 3, Mistral).
TEMPLATES = {"presets": False, "presets, thinking": True, "llama3": False, "mistral": False}


@pytest.mark.parametrize("record", RECORDS)
@pytest.mark.parametrize("template", TEMPLATES)
def test_the_ids_are_the_rendered_text_tokenised_whole(family_tokenizers, tokenizer, template, record):
    tok = family_tokenizers.get(template, tokenizer)
    thinking = TEMPLATES[template]
    cfg = DataConfig(
        system_prompt="" if template == "mistral" else DataConfig.system_prompt, enable_thinking=thinking
    )
    row = row_from_record(RECORDS[record], cfg, "x:1")
    chat = [{"role": m.role, "content": m.content} for m in messages_of(row, cfg)]
    end = ChatFormatter(tok, cfg).end.token
    rendered = tok.apply_chat_template(chat, tokenize=False, enable_thinking=thinking)
    rendered = rendered[: rendered.rindex(end) + len(end)]  # the template's text after it trains nothing
    whole = tok.encode(rendered, add_special_tokens=False)
    example = ChatFormatter(tok, cfg).encode(row)
    assert example.input_ids == whole and example.truncated_tokens == 0
    assert_shifted(example)
    answers = [m["content"] + end for m in chat if m["role"] == "assistant"]
    answers[-1] = ("<think>\n\n</think>\n\n" if thinking else "") + answers[-1]  # the final answer's opening
    assert targets(tok, example) == answers
    prompt = tok.apply_chat_template(
        chat[:-1], tokenize=False, add_generation_prompt=True, enable_thinking=thinking
    )
    assert ChatFormatter(tok, cfg).generation_ids(list(messages_of(row, cfg))[:-1]) == tok.encode(
        prompt, add_special_tokens=False
    )


@pytest.mark.parametrize("policy", ["head", "tail", "middle"])
@pytest.mark.parametrize("template", TEMPLATES)
def test_a_cut_row_is_a_cut_of_the_whole_tokenization(family_tokenizers, tokenizer, template, policy):
    tok = family_tokenizers.get(template, tokenizer)
    transcript = " ".join(f"Speaker {i}: item {i} is done." for i in range(60))
    row = SummaryRow(transcript, "All done.", "m:1")
    thinking = TEMPLATES[template]
    cfg = DataConfig(system_prompt="", enable_thinking=thinking, max_length=160, truncation=policy)
    whole = ChatFormatter(tok, replace(cfg, max_length=4096)).encode(row)
    example = ChatFormatter(tok, cfg).encode(row)
    kept = len(example.input_ids)
    assert kept == 160 and example.truncated_tokens == len(whole.input_ids) - kept
    head = next(i for i, (a, b) in enumerate(zip(example.input_ids, whole.input_ids, strict=False)) if a != b)
    tail = kept - head
    assert example.input_ids == whole.input_ids[:head] + whole.input_ids[len(whole.input_ids) - tail :]
    assert (
        tok.decode(whole.input_ids[head : len(whole.input_ids) - tail]) in transcript
    )  # only transcript cut
    assert example.labels[head:] == whole.labels[len(whole.labels) - tail :]  # the answer's labels, as whole


def test_llama3_meeting_keeps_its_system_prompt(family_tokenizers):
    tokenizer = family_tokenizers["llama3"]
    formatter = ChatFormatter(tokenizer, DataConfig(max_length=512))
    example = formatter.encode(SummaryRow("Anna: we ship on Friday.", "Ships Friday.", "m:1"))
    assert targets(tokenizer, example) == ["Ships Friday.<|eot_id|>"]
    assert tokenizer.decode(example.input_ids).startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful"
    )


def test_a_template_without_system_messages_is_refused_with_the_fix(family_tokenizers):
    formatter = ChatFormatter(family_tokenizers["mistral"], DataConfig(max_length=512))
    with pytest.raises(ConfigError, match=r'alternate.*data\.system_prompt=""'):
        formatter.encode(SummaryRow("Anna: we ship on Friday.", "Ships Friday.", "m:1"))
    meeting = ChatFormatter(family_tokenizers["mistral"], DataConfig(system_prompt="", max_length=512))
    example = meeting.encode(SummaryRow("Anna: we ship on Friday.", "Ships Friday.", "m:1"))
    assert targets(family_tokenizers["mistral"], example) == ["Ships Friday.</s>"]


def test_thinking_needs_a_template_with_a_thinking_mode(family_tokenizers, tokenizer):
    assert check_chat_template(tokenizer, DataConfig(enable_thinking=True)).token == "<|im_end|>"
    with pytest.raises(ConfigError, match="no thinking mode"):
        check_chat_template(family_tokenizers["llama3"], DataConfig(enable_thinking=True))


@pytest.mark.parametrize(
    ("template", "phrase"),
    [
        (None, "has no chat template"),
        ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n###\n{% endfor %}", "no special token"),
        ("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}", "does not write"),
        ("{% for m in messages %}{{ m['content'] }{% endfor %}", "refuses a chat"),
        # beyond the sandbox's limits, or failing in its own code: the template's fault, said so
        ("{% for i in range(10**9) %}{% endfor %}", "refuses a chat .*OverflowError: Range too big"),
        ("{{ messages[0]['content'] | int // 0 }}", "refuses a chat .*ZeroDivisionError"),
        ("{{ messages[5]['content'] }}", "refuses a chat .*no element 5"),
    ],
)  # fmt: skip
def test_templates_distft_cannot_train_with_are_refused_before_launch(family_tokenizers, template, phrase):
    tokenizer = family_tokenizers["llama3"]
    saved = tokenizer.chat_template
    tokenizer.chat_template = template
    try:
        with pytest.raises(ConfigError, match=phrase):
            check_chat_template(tokenizer, DataConfig())
        assert check_chat_template(tokenizer, DataConfig(format="text")) is None  # plain text needs none
    finally:
        tokenizer.chat_template = saved


def test_a_model_directory_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 128_256 // 4}))
    with pytest.raises(ConfigError, match="no tokenizer files"):
        load_tokenizer(str(tmp_path))
