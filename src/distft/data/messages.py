"""A chat turn, and a list of `{role, content}` objects read into turns (chat rows and the
conversations of preference rows alike), each fault named by row and turn."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distft.config.choices import ROLES
from distft.errors import DataError, one_line


@dataclass(frozen=True)
class Message:
    """One chat turn. Its content is its parts joined by a blank line: truncation may cut a part
    of a prompt turn (alpaca's input, not its instruction), never an assistant turn."""

    role: str  # system | user | assistant
    parts: tuple[str, ...]

    @property
    def content(self) -> str:
        return "\n\n".join(self.parts)


def parse_messages(turns: Any, origin: str, field: str = "messages") -> list[Message]:
    """`turns`, the value of the row's `field`: a non-empty list of {role, content} objects."""
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{origin}: `{field}` must be a non-empty list of {{role, content}} objects.")
    messages = []
    for i, turn in enumerate(turns):
        where = f"{origin}: {'message' if field == 'messages' else f'{field} message'} {i}"
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise DataError(f"{where} is not a {{role, content}} object (got {turn!r:.80}).")
        if turn["role"] not in ROLES:
            raise DataError(f"{where} has role {turn['role']!r}; chat rows take {', '.join(ROLES)} turns.")
        if not isinstance(turn["content"], str):
            raise DataError(
                f"{where} ({turn['role']}): content is not text (got {type(turn['content']).__name__})."
            )
        messages.append(Message(turn["role"], (turn["content"].strip(),)))
    return messages


def fields_of(record: dict[str, Any]) -> str:
    """A record's field names, sorted, for a message that names what a row has."""
    return ", ".join(one_line(name) for name in sorted(map(str, record)))
