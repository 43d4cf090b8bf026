"""`data.chat_template`: a run's chat template, inline or in a file, in place of its tokenizer's own.

`with_chat_template` gives every consumer of a run's tokenizer (`load_tokenizer`, `ChatFormatter`,
the token cache's key, the checks before launch of `distft.data.template`) the template the run
renders, so the tokenizer saved beside the run's weights carries it too.
"""

from __future__ import annotations

import copy
from pathlib import Path

from jinja2.exceptions import TemplateError, TemplateSyntaxError
from transformers import PreTrainedTokenizerBase

from distft.errors import ConfigError

TEMPLATE_SUFFIXES = (".jinja", ".j2", ".txt")  # data.chat_template names a file; else it is inline


def template_path(setting: str) -> Path | None:
    """The file data.chat_template names, or None when it is a template inline (it holds Jinja's
    `{{` or `{%`). A relative path is read from the working directory until the run's config
    makes it absolute (`distft.train.prepare.resolve_local_paths`)."""
    if not setting or "{{" in setting or "{%" in setting:
        return None
    if not setting.endswith(TEMPLATE_SUFFIXES):
        raise ConfigError(
            f"data.chat_template={setting[:80]!r} is neither a Jinja chat template (it has no {{{{ or {{%) nor "
            f"a template file (a name ending in {', '.join(TEMPLATE_SUFFIXES)}): give the template inline, "
            "or the path of the file that holds it, or leave it empty for the tokenizer's own."
        )
    return Path(setting).expanduser()


def chat_template_text(setting: str) -> tuple[str, str]:
    """data.chat_template's Jinja text, and how a refusal names it ("data.chat_template (FILE)")."""
    path = template_path(setting)
    if path is None:
        return setting, "data.chat_template (inline)"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        why = "not UTF-8 text" if isinstance(err, UnicodeDecodeError) else (err.strerror or str(err))
        raise ConfigError(
            f"data.chat_template={setting}: the template file cannot be read ({why}). Name a .jinja file "
            "that holds a chat template, or leave the setting empty for the tokenizer's own template."
        ) from None
    if not text.strip():
        raise ConfigError(f"data.chat_template={setting}: the template file is empty.")
    return text, f"data.chat_template ({path})"


def with_chat_template(tokenizer: PreTrainedTokenizerBase, setting: str) -> PreTrainedTokenizerBase:
    """`tokenizer` with data.chat_template (`setting`) as its chat template: a shallow copy, the
    offline tokenizer being shared (its vocabulary is not changed, only the template); `tokenizer`
    itself when `setting` is empty or it has that template already. Every consumer of a run's
    tokenizer calls it (`load_tokenizer`, `ChatFormatter`, the cache key, `check_chat_template`),
    so a caller that loaded the model's own tokenizer renders the run's template all the same. A
    template that does not parse is a ConfigError naming the setting and the line; what it renders
    is checked before launch (`distft.data.template`)."""
    if not setting:
        return tokenizer
    text, name = chat_template_text(setting)
    if tokenizer.chat_template == text:
        return tokenizer
    custom = copy.copy(tokenizer)
    custom.chat_template = text
    custom.distft_chat_template = name  # how `distft.data.template`'s refusals name the template
    try:  # transformers compiles the template on its first use: a one-turn chat
        custom.apply_chat_template([{"role": "user", "content": "probe"}], tokenize=False)
    except TemplateSyntaxError as err:
        raise ConfigError(
            f"{name} is not a Jinja template that parses: line {err.lineno}: {err.message}. Fix the "
            "template, or leave data.chat_template empty for the tokenizer's own."
        ) from None
    except TemplateError:
        pass  # it parses, and refuses this chat: the checks of its chats say how, before launch
    return custom
