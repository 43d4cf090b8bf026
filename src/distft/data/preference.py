"""Preference rows: two answers to one prompt, the one to prefer and the one to avoid, for the
preference objectives (`train.objective = dpo | orpo | kto`, `distft.model.preference`); and
unpaired rows, one answer labelled desirable or not (KTO's data).

Pairs come in two shapes, told apart by the fields a row has (`data.format = preference`, or `auto`):

- `{"prompt", "chosen", "rejected"}`: the prompt a string (one user turn) or a list of
  {role, content} turns; each answer a string (one assistant turn) or the list of turns that
  follows the prompt; or `{"transcript", "chosen", "rejected"}`, a meeting asked for its summary
  as a summary row is (`data.system_prompt`, `data.instruction`; `--data sample-pairs`);
- whole conversations under `chosen` and `rejected`, each a list of turns that starts with the
  prompt's own (Anthropic's HH-RLHF as messages, UltraFeedback-binarized, which also repeats the
  prompt as a string under `prompt`): what the two share is the prompt, found token by token when
  the pair is tokenised (`distft.data.pairs`), so only the answers carry loss.

An unpaired row is `{"prompt", "completion", "label"}` (TRL's unpaired preference shape; a
meeting's `transcript` may stand for the prompt), `label` true for a desirable answer
(`data.format = unpaired`, or `auto`). KTO also reads pairs, each as two unpaired rows: the chosen
answer desirable, the rejected one not (`unpaired`).

A row whose answers are the same, that lacks `chosen` or `rejected` (named), or that does not end
both in an assistant turn, is refused with its origin; so are whole conversations that differ in a
turn before their final answers (a user turn of the rejected side would otherwise be part of its
answer, not of the prompt they share). Read by an SFT run, a preference row trains on its chosen
answer (`messages_of`), and `distft eval` scores against it; an unpaired row's undesirable answer
is refused there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distft.config import DataConfig
from distft.data.messages import Message, fields_of, parse_messages
from distft.errors import DataError
from distft.text import plural

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


@dataclass(frozen=True)
class UnpairedRow:
    prompt: tuple[Message, ...]
    completion: tuple[Message, ...]  # the turns after the prompt, ending with an assistant turn
    desirable: bool  # `label`
    origin: str
    format: str = "unpaired"

    @property
    def messages(self) -> tuple[Message, ...]:
        return self.prompt + self.completion


def _prompt(record: dict[str, Any], cfg: DataConfig, origin: str, answer: str) -> tuple[Message, ...]:
    """A row's `prompt`, or a meeting's `transcript` asked for its summary as a summary row is."""
    if "prompt" in record:
        return _turns(record["prompt"], "user", origin, "prompt")
    if isinstance(record.get("transcript"), str) and record["transcript"].strip():
        return meeting_prompt(record["transcript"].strip(), cfg)
    raise DataError(
        f"{origin}: `{answer}` holds only the answer, and the row has no `prompt` to answer: add one"
        + (", or give whole conversations under `chosen` and `rejected`." if answer == "chosen" else ".")
    )


def _required(record: dict[str, Any], fields: tuple[str, ...], origin: str, row: str) -> None:
    """A DataError naming the first of `fields` the record lacks (or holds as null)."""
    for field in fields:
        if record.get(field) is None:
            null = " (it is null)" if field in record else ""
            raise DataError(
                f"{origin}: missing field `{field}`{null} (row has: {fields_of(record)}); {row} needs "
                f"{' and '.join(f'`{f}`' for f in fields)}."
            )


def _ends_in_answer(turns: tuple[Message, ...], origin: str, name: str) -> None:
    if turns[-1].role != "assistant" or not turns[-1].content:
        raise DataError(f"{origin}: `{name}` must end with a non-empty assistant turn.")


def unpaired_row(record: dict[str, Any], cfg: DataConfig, origin: str) -> UnpairedRow:
    """A record with a `completion`, its `label` (true: desirable) and a `prompt` (or `transcript`)."""
    _required(record, ("completion", "label"), origin, "an unpaired row")
    label = record["label"]
    if not isinstance(label, bool):
        raise DataError(
            f"{origin}: an unpaired row's `label` is true (a desirable answer) or false (an undesirable "
            f"one); got {label!r:.40}."
        )
    completion = _turns(record["completion"], "assistant", origin, "completion")
    _ends_in_answer(completion, origin, "completion")
    return UnpairedRow(_prompt(record, cfg, origin, "completion"), completion, label, origin)


def unpaired(row: PreferenceRow) -> tuple[UnpairedRow, UnpairedRow]:
    """A pair as KTO reads it: its chosen answer desirable, its rejected one not. Whole
    conversations give the turns before their final answers, which they share, as the prompt."""
    prompt = row.prompt or row.chosen[:-1]
    chosen, rejected = row.chosen_messages[len(prompt) :], row.rejected_messages[len(prompt) :]
    return UnpairedRow(prompt, chosen, True, row.origin), UnpairedRow(prompt, rejected, False, row.origin)


def _same_prompt(chosen: tuple[Message, ...], rejected: tuple[Message, ...], origin: str) -> None:
    """Whole conversations: every turn before the final answer is the prompt, and must be the same
    in both (else the shared part would be the prompt, and a turn of one side trained as answer)."""
    a, b = chosen[:-1], rejected[:-1]
    if a == b:
        return
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    if i < min(len(a), len(b)):
        said = f"turn {i} differs: {_said(a[i])} in `chosen`, {_said(b[i])} in `rejected`"
    else:
        said = f"`chosen` has {plural(len(a), 'turn')} before it, `rejected` {plural(len(b), 'turn')}"
    raise DataError(
        f"{origin}: `chosen` and `rejected` must share every turn before the final assistant answer "
        f"(the prompt), and {said}."
    )


def _said(turn: Message) -> str:
    return f"{turn.role} {turn.content!r:.60}"


def preference_row(record: dict[str, Any], cfg: DataConfig, origin: str) -> PreferenceRow:
    """A record with `chosen` and `rejected`, and a `prompt` (or a meeting's `transcript`, asked for
    its summary as a summary row is), unless they are whole conversations."""
    _required(record, PREFERENCE_FIELDS, origin, "a preference row")
    chosen = _turns(record["chosen"], "assistant", origin, "chosen")
    rejected = _turns(record["rejected"], "assistant", origin, "rejected")
    for name, turns in (("chosen", chosen), ("rejected", rejected)):
        _ends_in_answer(turns, origin, name)
    whole = "assistant" not in (chosen[0].role, rejected[0].role)  # conversations that carry the prompt
    if whole or chosen[0].role != rejected[0].role:
        _same_prompt(chosen, rejected, origin)
    prompt = () if whole else _prompt(record, cfg, origin, "chosen")
    if chosen == rejected:
        raise DataError(f"{origin}: `chosen` and `rejected` are the same answer: nothing to prefer.")
    return PreferenceRow(prompt, chosen, rejected, origin)
