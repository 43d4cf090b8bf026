"""A setting outside its choices: the error names the valid ones, or the close match meant."""

from __future__ import annotations

import difflib

from distft.errors import ConfigError


def nearest(name: str, choices: list[str]) -> str:
    """ " Did you mean `x`?" for a close match, else the valid choices."""
    match = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" Did you mean `{match[0]}`?" if match else f" Valid: {', '.join(sorted(choices))}."


def check_choice(value: str, choices: tuple[str, ...] | list[str], where: str) -> None:
    if value not in choices:
        # The choices are listed once; `nearest` would list them again when nothing is close.
        match = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.5)
        hint = f" Did you mean `{match[0]}`?" if match else ""
        raise ConfigError(f"`{where}` is {value!r}; choose one of {', '.join(choices)}.{hint}")
