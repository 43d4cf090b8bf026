"""A real checkpoint's own tokenizer and chat template: the end-of-turn token read from the
template, label masks that cover exactly each answer and its end-of-turn token, and the
refusals before launch. Tokenizer-only (no model), on Llama 3 and Mistral templates over the
bundled vocabulary (`tests.chat_templates`)."""

from __future__ import annotations

import json

import pytest

from distft.config import DataConfig
from distft.data import ChatFormatter, check_chat_template, load_tokenizer
from distft.data.formats import ChatRow, Message, SummaryRow
from distft.errors import ConfigError
from tests.chat_templates import tokenizer_dir
from tests.data.test_formats import assert_shifted, targets

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
