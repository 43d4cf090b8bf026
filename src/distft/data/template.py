"""What distft needs of a model's chat template, read from the template itself.

Every family closes an assistant turn with its own token: Qwen's `<|im_end|>`, Llama 3's
`<|eot_id|>`, Mistral's `</s>`. Nothing here knows those names: the template renders a probe
chat whose texts are markers, and the text it puts after the assistant's marker names the
end-of-turn token (the first special token there). The same probing finds what a template opens an
answer with beyond the generation prompt (Qwen3's think block with `enable_thinking`), which the
model must learn to write (`distft.data.chat`).

A template that cannot serve training is refused with a `ConfigError` before launch
(`check_chat_template`): none at all (a base checkpoint's tokenizer), one that refuses the chat's
roles (Mistral v0.1 takes no system message), one that never renders an answer, one whose turn
ends in no special token, and `data.enable_thinking` on a template without a thinking mode. A
template given by `data.chat_template` (`distft.data.chat_template.with_chat_template`) is named by
that setting in each refusal, with the fix that is the user's to make.

A GGUF export carries the template with the run's `enable_thinking` inside (`trained_template`):
llama.cpp passes none, and Qwen3's prompt would lack the empty think block distft trained with
thinking off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jinja2.exceptions import TemplateError

from distft.config import DataConfig
from distft.data.chat_template import with_chat_template
from distft.errors import ConfigError


def marker(i: int, j: int) -> str:
    """The text standing in for part j of message i while the template renders (`distft.data.chat`)."""
    return f"\x00{i}:{j}\x00"


@dataclass(frozen=True)
class EndOfTurn:
    """The token that closes an assistant turn: a label the model learns, and where generation stops."""

    token: str  # "<|im_end|>", "<|eot_id|>", "</s>"
    id: int


def model_name(tokenizer: Any) -> str:
    return getattr(tokenizer, "name_or_path", "") or "the model"


def template_name(tokenizer: Any) -> str:
    """How a refusal names the template: `data.chat_template (FILE)` where the run set one, else
    the chat template of the model."""
    return getattr(tokenizer, "distft_chat_template", "") or f"The chat template of {model_name(tokenizer)}"


def _fix(tokenizer: Any, usual: str) -> str:
    """The fix a refusal offers: `usual` for a model's own template; for data.chat_template, the
    template to mend, or the setting to drop."""
    if getattr(tokenizer, "distft_chat_template", ""):
        return "Fix the template, or leave data.chat_template empty for the tokenizer's own."
    return usual


def render(tokenizer: Any, slots: list[dict], generation: bool, enable_thinking: bool) -> str:
    """The template's text for `slots`; a template that refuses the chat, or fails on it, is a ConfigError."""
    if not tokenizer.chat_template:
        raise ConfigError(
            f"The tokenizer of {model_name(tokenizer)} has no chat template (a base checkpoint's often has "
            "none), and distft renders every chat row through it. Use the instruct release's tokenizer "
            "files (its tokenizer_config.json or chat_template.jinja carries the template), or train on "
            "plain text (data.format=text)."
        )
    try:
        return tokenizer.apply_chat_template(
            slots, tokenize=False, add_generation_prompt=generation, enable_thinking=enable_thinking
        )
    except (TemplateError, ArithmeticError, LookupError, TypeError, ValueError, RecursionError) as err:
        # Anything the template's own code raises is the template's: Jinja's sandbox refuses a
        # range over 100,000 (OverflowError), a filter meets a value it cannot take (TypeError).
        if not isinstance(err, TemplateError):
            err = f"{type(err).__name__}: {err}"
        roles = [s["role"] for s in slots]
        hint = (
            ' If it takes no system message, set data.system_prompt="" and leave system turns out of the data.'
            if "system" in roles
            else ""
        )
        raise ConfigError(
            f"{template_name(tokenizer)} refuses a chat of the roles {roles}: {err}.{hint}"
        ) from None


def special_tokens(tokenizer: Any) -> set[str]:
    """The tokenizer's special tokens: its named ones and every added token marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return {t.content for t in added.values() if t.special} | set(tokenizer.all_special_tokens)


def end_of_turn(tokenizer: Any) -> EndOfTurn:
    """The first special token the template writes after an assistant's text."""
    slots = [{"role": "user", "content": marker(0, 0)}, {"role": "assistant", "content": marker(1, 0)}]
    text = render(tokenizer, slots, generation=False, enable_thinking=False)
    name = template_name(tokenizer)
    if marker(1, 0) not in text:
        raise ConfigError(
            f"{name} does not write an assistant message's content, so distft cannot place the answer it "
            f"trains on (no token could carry loss). {_fix(tokenizer, 'Use the template the model was released with.')}"
        )
    closing = text.split(marker(1, 0), 1)[1]
    found = [(closing.find(t), -len(t), t) for t in special_tokens(tokenizer) if t and t in closing]
    if not found:
        usual = "Mark the end-of-turn token special in the tokenizer's files."
        raise ConfigError(
            f"{name} ends an assistant turn with {closing!r}, which holds no special token of its "
            "tokenizer: distft needs one to close an answer (the model learns to write it, and generation "
            f"stops at it). {_fix(tokenizer, usual)}"
        )
    token = min(found)[2]  # the earliest; of two starting together, the longer
    return EndOfTurn(token, tokenizer.convert_tokens_to_ids(token))


def opening(tokenizer: Any, slots: list[dict], i: int, text: str, enable_thinking: bool) -> str:
    """What `text` (the whole chat rendered) writes before assistant message i's content beyond the
    generation prompt of the chat before it: the model must write it, so it is a target. Qwen3 with
    `enable_thinking` opens the final answer with its think block; most templates add nothing."""
    prompt = render(tokenizer, slots[:i], generation=True, enable_thinking=enable_thinking)
    before = text.split(marker(i, 0), 1)[0]
    # An earlier answer (Qwen3's turns before the last user message) may be rendered unlike a
    # generation prompt; only a rendering that extends the prompt has an opening.
    return before[len(prompt) :] if before.startswith(prompt) else ""


def check_chat_template(tokenizer: Any, cfg: DataConfig) -> EndOfTurn | None:
    """Refuse, before launch, a template that cannot close a turn or think as asked; None for plain
    text. A chat the template refuses (its roles) is refused as it is tokenised, also before launch."""
    tokenizer = with_chat_template(tokenizer, cfg.chat_template)  # data.chat_template, if set
    if cfg.format == "text" and not cfg.sources:
        return None
    turn = end_of_turn(tokenizer)
    if cfg.enable_thinking and "enable_thinking" not in tokenizer.chat_template:
        raise ConfigError(
            f"{template_name(tokenizer)} has no thinking mode (Qwen3's has), and data.enable_thinking=true "
            "asks for one: set data.enable_thinking=false."
        )
    return turn


def trained_template(tokenizer: Any, enable_thinking: bool) -> str:
    """The chat template with the run's `enable_thinking` set inside it, so that a caller passing none
    (llama.cpp, Ollama) renders the prompt training rendered; a template without one is unchanged."""
    if "enable_thinking" not in tokenizer.chat_template:
        return tokenizer.chat_template
    return f"{{%- set enable_thinking = {str(enable_thinking).lower()} %}}{tokenizer.chat_template}"
