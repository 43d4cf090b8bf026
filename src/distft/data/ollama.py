"""A run's chat template as Ollama's Modelfile, which a GGUF export writes beside its file.

Ollama renders prompts with Go templates, and reads a GGUF's Jinja `tokenizer.chat_template` only
when it recognises it. `ollama_template` writes the run's own as one: the texts its Jinja template
puts around a system prompt, each user and assistant turn and the generation prompt (the run's
`enable_thinking` included: Qwen3's empty think block with thinking off), cut from its rendering of
a probe chat and kept only if they render the probes again, with and without a system prompt.
"""

from __future__ import annotations

import contextlib
from string import Template
from typing import Any

from distft.data.template import end_of_turn, marker, render
from distft.errors import ConfigError

# Ollama's Execute: .System joins the system messages, .Messages holds every message (system too).
GO_TEMPLATE = Template(
    "{{ if .System }}$system{{ .System }}$system_end{{ else }}$head{{ end }}{{ range .Messages }}"
    '{{ if eq .Role "user" }}$user{{ .Content }}$user_end'
    '{{ else if eq .Role "assistant" }}$assistant{{ .Content }}$assistant_end{{ end }}{{ end }}$prompt'
)


PROBE = ["system", "user", "assistant", "user", "assistant", "user"]  # and PROBE[1:], without a system


def _probe(tokenizer: Any, roles: list[str], enable_thinking: bool) -> str:
    slots = [{"role": role, "content": marker(i, 0)} for i, role in enumerate(roles)]
    return render(tokenizer, slots, True, enable_thinking)


def _as_go(parts: dict[str, str], roles: list[str]) -> str:
    """What GO_TEMPLATE renders for a probe chat of `roles`."""
    skip = int(roles[0] == "system")
    text = parts["system"] + marker(0, 0) + parts["system_end"] if skip else parts["head"]
    for i, role in enumerate(roles[skip:], skip):
        text += parts[role] + marker(i, 0) + parts[f"{role}_end"]
    return text + parts["prompt"]


def ollama_template(tokenizer: Any, enable_thinking: bool) -> str | None:
    """The chat template as Ollama's Go template: the texts the Jinja template writes around a
    system prompt, each user and assistant turn and the generation prompt, cut from its rendering of
    a probe chat, kept only if they render the probes again. None for a template whose turns are
    not fixed texts (Mistral's folds the system prompt into the last user turn)."""
    try:
        end = end_of_turn(tokenizer).token
        texts = [_probe(tokenizer, roles, enable_thinking) for roles in (PROBE, PROBE[1:])]
    except ConfigError:
        return None

    def cut(gap: str) -> tuple[str, str]:  # a turn's close (to its end-of-turn token), the next one's open
        before, found, after = gap.partition(end)
        opening = after.lstrip()
        return before + found + after[: len(after) - len(opening)], opening

    gaps, rest = [], texts[0]
    for i in range(len(PROBE)):  # a message left out leaves gaps that render nothing right
        gap, _, rest = rest.partition(marker(i, 0))
        gaps.append(gap)
    (system_end, user), (user_end, assistant), (assistant_end, _) = map(cut, gaps[1:4])
    parts = dict(system=gaps[0], system_end=system_end, user=user, user_end=user_end, assistant=assistant,
                 assistant_end=assistant_end, prompt=rest.removeprefix(user_end),
                 head=texts[1].partition(marker(0, 0))[0].removesuffix(user))  # fmt: skip
    # `{{` would be read as a Go action; `"""` ends the Modelfile's value
    if any("{{" in text or '"""' in text for text in parts.values()):
        return None
    if [_as_go(parts, roles) for roles in (PROBE, PROBE[1:])] != texts:
        return None
    if tokenizer.bos_token and tokenizer.encode("a")[:1] == [tokenizer.bos_token_id]:
        # llama.cpp adds the bos as it tokenizes (and drops it from a rendered Jinja template too)
        parts["system"], parts["head"] = (
            parts[k].removeprefix(tokenizer.bos_token) for k in ("system", "head")
        )
    return GO_TEMPLATE.substitute(parts).replace("{{ else }}{{ end }}", "{{ end }}")  # no head: no else


def modelfile(gguf_name: str, tokenizer: Any, enable_thinking: bool, system: str) -> str:
    """The Modelfile of the GGUF file `gguf_name` beside it: the template rendering the prompt distft
    trained on, the run's system prompt (if `system`), generation stopped at the end of the turn."""
    template = ollama_template(tokenizer, enable_thinking)
    stops = [tokenizer.eos_token]
    with contextlib.suppress(ConfigError):  # no chat template: end of text alone
        stops.insert(0, end_of_turn(tokenizer).token)
    return "\n".join(
        [
            f"FROM ./{gguf_name}",
            f'TEMPLATE """{template}"""'
            if template
            else "# no TEMPLATE: the chat template's turns are no fixed texts",
            *([f'SYSTEM """{system}"""'] if system else []),
            *(f"PARAMETER stop {stop}" for stop in dict.fromkeys(stops) if stop),
            "",
        ]
    )
