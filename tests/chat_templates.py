"""Other families' chat templates on the bundled Qwen3 vocabulary, for offline tests: the
tokenizer a real Llama 3 or Mistral checkpoint ships is its own, but what distft reads of it (the
template, its special tokens) is the same in kind. Each builder saves a tokenizer directory, as a
model directory holds one."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from distft.data.tokenizer import qwen3_tokenizer

# Meta-Llama-3-8B-Instruct's template, as released (tokenizer_config.json).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Mistral-7B-Instruct-v0.1's template, as released: [INST] turns, `</s>` after each answer, and
# no system message.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
STYLES = {
    "llama3": (
        LLAMA3_TEMPLATE,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    ),
    "mistral": (
        MISTRAL_TEMPLATE,
        ["<s>", "</s>", "[INST]", "[/INST]"],
        {"bos_token": "<s>", "eos_token": "</s>"},
    ),
}


def styled_tokenizer(style: str) -> PreTrainedTokenizerBase:
    """The bundled vocabulary in `style`: the family's special tokens added (ids above Qwen3's,
    inside the presets' 151,936 embedding rows) and its chat template."""
    template, added, named = STYLES[style]
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer().name_or_path)  # a copy: the shared one stays
    tokenizer.add_special_tokens({"additional_special_tokens": added, **named})
    tokenizer.chat_template = template
    return tokenizer


def tokenizer_dir(style: str, out: Path) -> Path:
    """`styled_tokenizer(style)` saved as a model directory holds it."""
    styled_tokenizer(style).save_pretrained(str(out))
    return out
