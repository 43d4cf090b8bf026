"""Preference rows: two answers to one prompt, the one to prefer and the one to avoid, for the
preference objectives (`train.objective = dpo | orpo`, `distft.model.preference`).

Two shapes, told apart by the fields a row has (`data.format = preference`, or `auto`):

- `{"prompt", "chosen", "rejected"}`: the prompt a string (one user turn) or a list of
  {role, content} turns; each answer a string (one assistant turn) or the list of turns that
  follows the prompt; or `{"transcript", "chosen", "rejected"}`, a meeting asked for its summary
  as a summary row is (`data.system_prompt`, `data.instruction`; `--data sample-pairs`);
- whole conversations under `chosen` and `rejected`, each a list of turns that starts with the
  prompt's own (Anthropic's HH-RLHF as messages, UltraFeedback-binarized, which also repeats the
  prompt as a string under `prompt`): what the two share is the prompt, found token by token when
  the pair is tokenised (`distft.data.pairs`), so only the answers carry loss.

A row whose answers are the same, or that does not end both in an assistant turn, is refused with
its origin. Read by an SFT run, a preference row trains on its chosen answer (`messages_of`), and
`distft eval` scores against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distft.config import DataConfig
from distft.data.messages import Message, parse_messages
from distft.errors import DataError

PREFERENCE_FIELDS = ("chosen", "rejected")


@dataclass(frozen=True)
class PreferenceRow:
    prompt: tuple[Message, ...]  # empty when each answer is a whole conversation
    chosen: tuple[Message, ...]  # the turns after the prompt (or the whole conversation)
    rejected: tuple[Message, ...]
    origin: str
    format: str = "preference"

    @property
    def chosen_messages(self) -> tuple[Message, ...]:
        return self.prompt + self.chosen

    @property
    def rejected_messages(self) -> tuple[Message, ...]:
        return self.prompt + self.rejected


def _turns(value: Any, role: str, origin: str, field: str) -> tuple[Message, ...]:
    """A string as one turn of `role`, or a list of turns."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{origin}: `{field}` is empty.")
        return (Message(role, (value.strip(),)),)
    return tuple(parse_messages(value, origin, field))


def meeting_prompt(transcript: str, cfg: DataConfig) -> tuple[Message, ...]:
    """The prompt that asks for a meeting's summary: the system prompt, then the instruction and
    the transcript (a summary row's, `distft.data.formats.messages_of`, and a meeting pair's)."""
    system = (Message("system", (cfg.system_prompt,)),) if cfg.system_prompt else ()
    return (*system, Message("user", (cfg.instruction, transcript)))


def preference_row(record: dict[str, Any], cfg: DataConfig, origin: str) -> PreferenceRow:
    """A record with `chosen` and `rejected`, and a `prompt` (or a meeting's `transcript`, asked for
    its summary as a summary row is), unless they are whole conversations."""
    for field in PREFERENCE_FIELDS:
        if field not in record:
            raise DataError(
                f"{origin}: a preference row needs `chosen` and `rejected`; `{field}` is missing."
            )
    chosen = _turns(record["chosen"], "assistant", origin, "chosen")
    rejected = _turns(record["rejected"], "assistant", origin, "rejected")
    whole = chosen[0].role != "assistant"  # a conversation that carries its prompt
    if whole:
        prompt: tuple[Message, ...] = ()
    elif "prompt" in record:
        prompt = _turns(record["prompt"], "user", origin, "prompt")
    elif isinstance(record.get("transcript"), str) and record["transcript"].strip():
        prompt = meeting_prompt(record["transcript"].strip(), cfg)
    else:
        raise DataError(
            f"{origin}: `chosen` holds only the answer, and the row has no `prompt` to answer: add one, "
            "or give whole conversations under `chosen` and `rejected`."
        )
    for name, turns in (("chosen", chosen), ("rejected", rejected)):
        if turns[-1].role != "assistant" or not turns[-1].content:
            raise DataError(f"{origin}: `{name}` must end with a non-empty assistant turn.")
    if chosen == rejected:
        raise DataError(f"{origin}: `chosen` and `rejected` are the same answer: nothing to prefer.")
    return PreferenceRow(prompt, chosen, rejected, origin)
