"""What the data tests share: the offline Qwen3 tokenizer, built once per module."""

import pytest

from distft.data.tokenizer import qwen3_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return qwen3_tokenizer()
