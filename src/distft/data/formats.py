"""Row formats: what one dataset row says, whichever of the eight shapes it comes in.

- `summary`: a meeting transcript and its summary, in one of the AMI schemas (`KNOWN_SCHEMAS`) or
  in fields named by `data.transcript_field` / `data.summary_field`;
- `chat`: `{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}`, multi-turn;
- `prompt_completion`: `{"prompt", "completion"}`;
- `alpaca`: `{"instruction", "input", "output"}`, `input` optional;
- `sharegpt`: `{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}`, its turn
  names mapped to chat roles by `DEFAULT_ROLES` and `data.roles`;
- `text`: `{"text": ...}`, plain text with loss on every token (a `TextRow`);
- `preference`: `{"prompt", "chosen", "rejected"}` or whole conversations (`distft.data.preference`);
- `unpaired`: `{"prompt", "completion", "label"}`, one answer labelled desirable or not (KTO).

`data.format=auto` detects the format from the fields each row has. A row whose fields fit more
than one format (alpaca's `input`/`output` are also qmsum-cleaned's transcript/summary) is
refused rather than guessed, except three overlaps resolved by rule: a row with an `instruction` is
alpaca, not qmsum's `{input, output}`; a row with a `label` is unpaired, not prompt_completion; and `text` fits only a row that fits nothing else (many
datasets carry a rendered `text` beside their `messages`). Every row becomes a `SummaryRow`
(summary), a `TextRow` (text) or a `ChatRow` (the rest); `messages_of` turns each into the
conversation that is tokenised (a text row: one user turn, which is what generation starts from).

Rows to generate for (`need_answer=False`: `distft infer --input FILE`) may lack their answer: a
meeting its summary, a prompt its completion, an alpaca row its output, and a chat may end with a
user turn (or an empty assistant turn). `prompt_and_reference` splits any row into the prompt
(the conversation up to its last assistant turn) and the reference (that turn's text, or "").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from distft.config import DataConfig
from distft.data.messages import Message, fields_of, parse_messages
from distft.data.preference import PreferenceRow, UnpairedRow, meeting_prompt, preference_row, unpaired_row
from distft.errors import DataError, one_line

# ShareGPT turn names (`from`) -> chat roles; data.roles adds names or maps them anew.
DEFAULT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bot": "assistant",
}

# (transcript field, summary field) of the summary schemas recognised without configuration.
KNOWN_SCHEMAS: list[tuple[str, str]] = [
    ("transcript", "summary"),  # distft sample meetings
    ("dialogue", "summary"),  # knkarthick/AMI
    ("input", "output"),  # pszemraj/qmsum-cleaned
    ("meeting_transcripts", "general_query_list"),  # QMSum raw
]

# Fields that make a row one of the other formats (alpaca's `input` is optional).
REQUIRED: dict[str, tuple[str, ...]] = {
    "chat": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "sharegpt": ("conversations",),
    "preference": ("chosen", "rejected"),  # `distft.data.preference`
    "unpaired": ("completion", "label"),  # and a prompt or transcript
}
ANSWER = {"prompt_completion": "completion", "alpaca": "output"}  # optional in a row to generate for
# Every field a row of each format may hold: a row that fits none is read as the format it seems to
# attempt (`_partial`), so that its parser names the field it lacks.
FIELDS: dict[str, tuple[str, ...]] = {
    "summary": tuple(field for schema in KNOWN_SCHEMAS for field in schema),
    **REQUIRED,
    "alpaca": ("instruction", "input", "output"),
    "preference": ("prompt", "transcript", "chosen", "rejected"),
    "unpaired": ("prompt", "transcript", "completion", "label"),
}


@dataclass(frozen=True)
class SummaryRow:
    transcript: str
    summary: str
    origin: str  # "file.jsonl:12" or "dataset[split][7]": where to look when something is wrong


@dataclass(frozen=True)
class ChatRow:
    messages: tuple[Message, ...]  # ends with an assistant turn, unless read to generate for
    origin: str
    # The format it was read from (chat, prompt_completion, alpaca, sharegpt): said, never compared.
    format: str = dataclasses.field(default="chat", compare=False)


@dataclass(frozen=True)
class TextRow:
    """Plain text to model: every token carries loss, no prompt, no chat template."""

    text: str
    origin: str


Row = SummaryRow | ChatRow | TextRow | PreferenceRow | UnpairedRow


def row_format(row: Row) -> str:
    """The `data.format` value `row` was read as (what `data.format=auto` detected for it)."""
    if isinstance(row, ChatRow | PreferenceRow | UnpairedRow):
        return row.format
    return "text" if isinstance(row, TextRow) else "summary"


def messages_of(row: Row, cfg: DataConfig) -> tuple[Message, ...]:
    """The conversation a row stands for; a meeting gets the configured system prompt and instruction."""
    if isinstance(row, ChatRow):
        return row.messages
    if isinstance(row, PreferenceRow):  # SFT on preference rows: the chosen answers
        return row.chosen_messages
    if isinstance(row, UnpairedRow):
        if not row.desirable:
            raise DataError(
                f"{row.origin}: an undesirable answer (label false) is not one to learn: unpaired rows "
                "train under train.objective=kto."
            )
        return row.messages
    if isinstance(row, TextRow):
        return (Message("user", (row.text,)),)
    return (*meeting_prompt(row.transcript, cfg), Message("assistant", (row.summary,)))


def prompt_and_reference(row: Row, cfg: DataConfig) -> tuple[tuple[Message, ...], str]:
    """What to generate from and what to compare with: the conversation up to (not including) its
    last assistant turn, and that turn's text; a row ending in another turn is all prompt, no reference."""
    if isinstance(row, UnpairedRow) and not row.desirable:  # no answer to compare with
        return row.prompt, ""
    messages = messages_of(row, cfg)
    if messages[-1].role == "assistant":
        return messages[:-1], messages[-1].content
    return messages, ""


# ---- detection -------------------------------------------------------------------------------


def _fits(record: dict[str, Any], cfg: DataConfig, need_answer: bool = True) -> list[str]:
    if cfg.transcript_field or cfg.summary_field:
        return ["summary"]  # naming the summary fields says which format this is
    schemas = [(t, s) for t, s in KNOWN_SCHEMAS if t in record and s in record]
    if "instruction" in record:  # alpaca's input/output, not qmsum-cleaned's transcript/summary
        schemas = [schema for schema in schemas if schema != ("input", "output")]
    fits = ["summary"] if schemas else []
    for name, fields in REQUIRED.items():
        needed = fields if need_answer else [f for f in fields if f != ANSWER.get(name)]
        if all(f in record for f in needed) and not (name == "prompt_completion" and "label" in record):
            fits.append(name)
    return fits or (["text"] if "text" in record else [])  # text: the format of last resort


def _partial(record: dict[str, Any]) -> str | None:
    """The format a row that fits none seems to attempt, if any: the one with most of the fields
    only it has (a pair's `chosen` or `rejected`, not the `prompt` a prompt_completion row has too),
    then with most of its fields; the first in `FIELDS` of those that tie."""
    owners = {field: sum(field in fields for fields in FIELDS.values()) for field in record}
    score = {
        name: (sum(owners.get(f) == 1 for f in fields), sum(f in record for f in fields))
        for name, fields in FIELDS.items()
    }
    best = max(FIELDS, key=score.__getitem__)  # max keeps the first of those that tie
    return best if score[best][1] else None


def detect_format(record: dict[str, Any], cfg: DataConfig, origin: str, need_answer: bool = True) -> str:
    """The one format `record` fits under data.format=auto; a DataError if none or several.
    With `need_answer=False` a prompt or an instruction without its completion/output fits."""
    fits = _fits(record, cfg, need_answer)
    if len(fits) > 1:
        raise DataError(
            f"{origin}: the row's fields ({fields_of(record)}) fit more than one format: {' and '.join(fits)}. "
            f"Say which with data.format={fits[-1]} (or data.format={fits[0]}); docs/data.md shows each format."
        )
    if fits:
        return fits[0]
    partial = _partial(record)
    if partial:
        return partial  # its parser names the missing field
    known = "; ".join(f"{{{t}, {s}}}" for t, s in KNOWN_SCHEMAS)
    raise DataError(
        f"{origin}: no transcript/summary fields found, nor any other known format (row has: {fields_of(record)}). "
        f"Summary schemas: {known}; chat {{messages}}; prompt_completion {{prompt, completion}}; alpaca "
        "{instruction, input, output}; sharegpt {conversations}; preference {prompt, chosen, rejected}; "
        "unpaired {prompt, completion, label}; "
        "text {text}. Name a summary's fields "
        "with data.transcript_field=... data.summary_field=..."
    )


# ---- parsing ---------------------------------------------------------------------------------


def _field(record: dict[str, Any], name: str, origin: str, optional: bool = False) -> str:
    if name not in record or (optional and record[name] is None):
        if optional:
            return ""
        raise DataError(f"{origin}: missing field `{one_line(name)}` (row has: {fields_of(record)}).")
    value = record[name]
    if not isinstance(value, str):
        raise DataError(f"{origin}: field `{name}` is not text (got {type(value).__name__}).")
    if not value.strip() and not optional:
        raise DataError(f"{origin}: field `{name}` is empty.")
    return value.strip()


def _text_of(value: Any, field: str) -> str:
    """Flatten QMSum's structured fields; plain strings pass through. TypeError: neither."""
    if isinstance(value, str):
        return value
    if field == "meeting_transcripts" and isinstance(value, list):
        if not all(isinstance(t, dict) and _texts(t, "speaker", "content") for t in value):
            raise TypeError("a turn is not a {speaker, content} object of text")
        return "\n".join(f"{turn['speaker']}: {turn['content']}" for turn in value)
    if field == "general_query_list" and isinstance(value, list):
        if not all(isinstance(q, dict) and _texts(q, "answer") for q in value):
            raise TypeError("a query is not a {query, answer} object of text")
        # The whole-meeting summary is the general query "Summarize the whole meeting."
        for query in value:
            if "whole meeting" in str(query.get("query", "")).lower():
                return query["answer"]
        return value[0]["answer"] if value else ""
    raise TypeError(f"unsupported value of type {type(value).__name__}")


def _texts(record: dict, *names: str) -> bool:
    return all(isinstance(record.get(name), str) for name in names)


def _summary_row(record: dict[str, Any], cfg: DataConfig, origin: str, need_answer: bool) -> SummaryRow:
    if cfg.transcript_field or cfg.summary_field:
        fields = (cfg.transcript_field or "transcript", cfg.summary_field or "summary")
    else:  # the first schema both of whose fields are present, else one with one of them
        fields = next((s for s in KNOWN_SCHEMAS if s[0] in record and s[1] in record), None)
        fields = fields or next(
            (s for s in KNOWN_SCHEMAS if s[0] in record or s[1] in record), KNOWN_SCHEMAS[0]
        )
    texts = []
    for field in fields:
        if field == fields[1] and record.get(field) in (None, "") and not need_answer:
            texts.append("")  # inference: a meeting to summarise need not carry a summary (a CSV cell: empty)
            continue
        if field not in record:
            raise DataError(f"{origin}: missing field `{one_line(field)}` (row has: {fields_of(record)}).")
        try:
            text = _text_of(record[field], field).strip()
        except (TypeError, KeyError) as err:
            raise DataError(f"{origin}: field `{field}` is not text ({err}).") from None
        if not text:
            raise DataError(f"{origin}: field `{field}` is empty.")
        texts.append(text)
    return SummaryRow(texts[0], texts[1], origin)


def _chat_row(record: dict[str, Any], origin: str, need_answer: bool = True, fmt: str = "chat") -> ChatRow:
    messages = parse_messages(record.get("messages"), origin)
    if not need_answer:  # a chat to continue: it may end with a user turn, or an empty answer to fill
        if messages[-1].role == "assistant" and not messages[-1].content:
            messages.pop()
        if messages and messages[-1].role != "assistant":
            return ChatRow(tuple(messages), origin, fmt)
    last = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=None)
    if last is None:
        raise DataError(f"{origin}: the chat has no assistant turn, so nothing to learn from.")
    if not messages[last].content:
        raise DataError(f"{origin}: message {last} (assistant) is empty.")
    # Turns after the last answer carry no loss and would only cost tokens.
    return ChatRow(tuple(messages[: last + 1]), origin, fmt)


def _single_turn(user: Message, answer: str, origin: str, fmt: str) -> ChatRow:
    """A one-exchange chat; without an answer (a row to generate for) the user turn alone."""
    return ChatRow((user, Message("assistant", (answer,))) if answer else (user,), origin, fmt)


def _prompt_completion_row(record: dict[str, Any], origin: str, need_answer: bool = True) -> ChatRow:
    prompt = _field(record, "prompt", origin)
    completion = _field(record, "completion", origin, optional=not need_answer)
    return _single_turn(Message("user", (prompt,)), completion, origin, "prompt_completion")


def _alpaca_row(record: dict[str, Any], origin: str, need_answer: bool = True) -> ChatRow:
    instruction = _field(record, "instruction", origin)
    output = _field(record, "output", origin, optional=not need_answer)
    given = _field(record, "input", origin, optional=True)
    user = Message("user", (instruction, given) if given else (instruction,))
    return _single_turn(user, output, origin, "alpaca")


def _sharegpt_row(record: dict[str, Any], cfg: DataConfig, origin: str, need_answer: bool = True) -> ChatRow:
    """A ShareGPT conversation as a chat: each turn's `from` mapped by `DEFAULT_ROLES` | data.roles."""
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{origin}: `conversations` must be a non-empty list of {{from, value}} objects.")
    roles = DEFAULT_ROLES | cfg.roles
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise DataError(f"{origin}: turn {i} is not a {{from, value}} object (got {turn!r:.80}).")
        if turn["from"] not in roles:
            seen = sorted({one_line(str(t.get("from"))) for t in turns if isinstance(t, dict)})
            raise DataError(
                f"{origin}: turn {i} is from {one_line(str(turn['from']))!r}, which is no known role (the "
                f"row's turns are from: {', '.join(seen)}). Map it with data.roles, e.g. "
                f'data.roles={{{one_line(str(turn["from"]))} = "assistant"}}; known: {", ".join(roles)}.'
            )
        messages.append({"role": roles[turn["from"]], "content": turn["value"]})
    return _chat_row({"messages": messages}, origin, need_answer, "sharegpt")


def _text_row(record: dict[str, Any], origin: str) -> TextRow:
    return TextRow(_field(record, "text", origin), origin)


def row_from_record(record: Any, cfg: DataConfig, origin: str, need_answer: bool = True) -> Row:
    """One dataset record as a row of `data.format` (detected when auto); bad rows name `origin`.
    With `need_answer=False` (rows to generate for) a row may lack its answer: a meeting its
    summary, a prompt its completion, an alpaca row its output; a chat may end with a user turn."""
    if not isinstance(record, dict):
        raise DataError(f"{origin}: expected a JSON object, got {type(record).__name__}.")
    fmt = detect_format(record, cfg, origin, need_answer) if cfg.format == "auto" else cfg.format
    if fmt == "summary":
        return _summary_row(record, cfg, origin, need_answer)
    if fmt == "chat":
        return _chat_row(record, origin, need_answer)
    if fmt == "prompt_completion":
        return _prompt_completion_row(record, origin, need_answer)
    if fmt == "sharegpt":
        return _sharegpt_row(record, cfg, origin, need_answer)
    if fmt == "text":
        return _text_row(record, origin)
    if fmt == "preference":
        return preference_row(record, cfg, origin)
    if fmt == "unpaired":
        return unpaired_row(record, cfg, origin)
    return _alpaca_row(record, origin, need_answer)
