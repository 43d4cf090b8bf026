"""The offline Qwen3 tokenizer must encode exactly like the released one."""

import pytest

from distft.data.tokenizer import (
    QWEN3_SPECIAL_TOKENS,
    build_qwen3_tokenizer,
    load_tokenizer,
    qwen3_tokenizer,
    save_tokenizer,
)


@pytest.mark.parametrize(
    ("text", "ids"),
    [  # ids published for the real Qwen3 tokenizer
        ("Hello world", [9707, 1879]),
        ("你好世界", [108386, 99489]),
        ("🚀", [145836]),
        ("<|im_start|>user\nHi<|im_end|>", [151644, 872, 198, 13048, 151645]),
        ("<think>", [151667]),
        ("</think>", [151668]),
    ],
)
def test_published_ids(tokenizer, text, ids):
    assert tokenizer.encode(text, add_special_tokens=False) == ids


def test_added_tokens_and_roles(tokenizer):
    assert len(QWEN3_SPECIAL_TOKENS) == 26
    for token, token_id in QWEN3_SPECIAL_TOKENS.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    assert tokenizer.encode("Hi") == [13048]  # no BOS/EOS added when encoding
    # Think tags are added tokens but not special: decoding keeps them.
    assert tokenizer.decode([151644, 151667, 13048], skip_special_tokens=True) == "<think>Hi"


def test_digits_split_one_by_one(tokenizer):
    # Qwen's pre-tokenizer splits numbers into single digits (cl100k groups up to three).
    assert tokenizer.encode("12345") == [16, 17, 18, 19, 20]


@pytest.mark.parametrize(
    "text",
    [
        "Anna: we agreed on 25 euros.\nTom: yes!",
        "def f(x):\n    return x**2\n",
        "Grüße, naïve café — 東京 🚀",
        "  leading spaces\n\n\ttabs",
    ],
)
def test_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_chat_template(tokenizer):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    prompt = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert (
        prompt == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    chat = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": "Yo"}], tokenize=False)
    assert chat.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nYo<|im_end|>\n")
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, enable_thinking=False, return_dict=False
    )
    assert ids[-1] == 271 and 151667 in ids  # "\n\n" after </think>


def test_chat_template_is_qwen3s_multi_turn_template(tokenizer):
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "<think>\nso\n</think>\n\nA2"},
    ]
    # Reasoning of turns before the last user message is dropped; the last answer keeps its think block.
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<think>\nso\n</think>\n\nA2<|im_end|>\n"
    )
    thinking = tokenizer.apply_chat_template(
        messages[:4], tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert thinking.endswith("Q2<|im_end|>\n<|im_start|>assistant\n")


def test_cache_is_identical_and_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTFT_CACHE", str(tmp_path))
    built = build_qwen3_tokenizer()
    first = qwen3_tokenizer()  # builds into the cache
    assert qwen3_tokenizer() is first  # loaded once per process
    second = load_tokenizer(str(tmp_path / "qwen3-tokenizer-v1"))  # the cache, read from disk again
    text = "The team agreed on 25 euros. <|im_end|>"
    assert built.encode(text) == first.encode(text) == second.encode(text)
    assert [p.name for p in tmp_path.iterdir()] == ["qwen3-tokenizer-v1"]  # no temporary left


def test_load_tokenizer_from_a_saved_directory(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    again = load_tokenizer(str(tmp_path))
    assert again.encode("Hello world") == [9707, 1879]
    assert again.pad_token_id == 151643


def test_saved_from_the_cache_are_the_bytes_save_pretrained_writes(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("DISTFT_CACHE", str(tmp_path / "cache"))
    tokenizer.save_pretrained(tmp_path / "plain")
    for out in ("first", "again"):  # written into the cache, then copied from it
        save_tokenizer(tokenizer, tmp_path / out)
        names = sorted(p.name for p in (tmp_path / "plain").iterdir())
        assert sorted(p.name for p in (tmp_path / out).iterdir()) == names
        assert all((tmp_path / out / n).read_bytes() == (tmp_path / "plain" / n).read_bytes() for n in names)
    assert len(list((tmp_path / "cache" / "saved-tokenizers").iterdir())) == 1  # no temporary left
