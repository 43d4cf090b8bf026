"""Config files: defaults, then a TOML file, then `section.key=value` overrides; and back to TOML.

`load_config` builds a `Config` in three layers, later ones winning: the dataclass defaults (the
embedded CPU default), an optional TOML file, and command-line overrides. The resolved config is
written to `DIR/config.toml` by `to_toml`, so `distft train --config DIR/config.toml` reproduces a
run. Every mistake is a `ConfigError` with a one-paragraph message: malformed TOML with its line
and column, unknown keys with the nearest valid one, wrong types, values out of range.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from pathlib import Path
from typing import Any

import tomllib

from distft.config.fields import check_fields, nearest
from distft.config.schema import Config
from distft.errors import ConfigError, DamagedFileError, one_line
from distft.textfiles import decode_utf8

_SECTION_TYPES = {  # the sections (the class variables `explicit`, `derived` ... are not)
    name: hint
    for name, hint in typing.get_type_hints(Config).items()
    if name in {f.name for f in dataclasses.fields(Config)}
}
# Sections newer than some saved runs: a run's config.toml written before them takes their defaults.
_LATER_SECTIONS = {"moe"}

# ---------------------------------------------------------------------------------------------
# Loading and overriding
# ---------------------------------------------------------------------------------------------


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check `value` against a field's type annotation, converting only lossless cases."""
    origin = typing.get_origin(annotation)
    if origin in (list, typing.List):  # noqa: UP006
        (item_type,) = typing.get_args(annotation)
        if isinstance(value, str):  # "a,b,c" on the command line
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"`{where}` must be a list, got {value!r}.")
        return [_coerce(v, item_type, where) for v in value]
    if origin is dict:  # a TOML table: `data.roles = {narrator = "system"}`
        if not isinstance(value, dict):
            raise ConfigError(f'`{where}` must be a table, e.g. {{name = "value"}}, got {value!r:.40}.')
        value_type = typing.get_args(annotation)[1]
        return {
            str(k): v if value_type is Any else _coerce(v, value_type, f"{where}.{k}")
            for k, v in value.items()
        }
    if origin in (typing.Union, types.UnionType):  # a setting of two forms, e.g. "balanced" or [5, 3]
        forms = typing.get_args(annotation)
        listed = [a for a in forms if typing.get_origin(a) in (list, typing.List)]  # noqa: UP006
        scalar = [a for a in forms if a not in listed]
        if len(listed) != 1 or len(scalar) != 1:
            raise TypeError(f"config unions are one scalar type and one list type ({where})")
        # A list, or a string with a comma ("5,3" on the command line), takes the list form.
        as_list = isinstance(value, list) or (isinstance(value, str) and "," in value)
        return _coerce(value, listed[0] if as_list else scalar[0], where)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"`{where}` must be true or false, got {value!r}.")
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ConfigError(f"`{where}` must be an integer, got {value!r:.40}.")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"`{where}` must be an integer, got {value!r:.40}.") from None
    if annotation is float:
        if isinstance(value, bool):
            raise ConfigError(f"`{where}` must be a number, got {value!r}.")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"`{where}` must be a number, got {value!r:.40}.") from None
        except OverflowError:  # an integer beyond any float
            raise ConfigError(f"`{where}` must be a finite number, got {value!r:.40}...") from None
    if annotation is str:
        if isinstance(value, bool):  # `model.compile = true`: a string field whose choices include it
            return "true" if value else "false"
        if not isinstance(value, str | int | float):
            raise ConfigError(f"`{where}` must be a string, got {value!r}.")
        try:  # a command-line argument of bytes that are not UTF-8 (surrogate escapes)
            str(value).encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"`{where}` is not UTF-8 text, got {value!r:.60}.") from None
        return str(value)
    raise TypeError(f"unsupported config type {annotation} ({where})")


@functools.cache
def _field_types(section_type: type) -> dict[str, Any]:
    # Resolving the annotations evaluates them again on every call: a config sets ~200 fields.
    return typing.get_type_hints(section_type)


def _apply(cfg: Config, section: str, key: str, value: Any) -> str:
    """Set one field; returns its dotted name."""
    if section not in _SECTION_TYPES:
        raise ConfigError(
            f"Unknown config section `{one_line(section)}`.{nearest(section, list(_SECTION_TYPES))}"
        )
    section_obj = getattr(cfg, section)
    hints = _field_types(type(section_obj))
    if key not in hints:
        keys = [f"{section}.{name}" for name in hints]  # the whole key: what an override writes
        raise ConfigError(
            f"Unknown config key `{section}.{one_line(key)}`.{nearest(f'{section}.{key}', keys)}"
        )
    setattr(section_obj, key, _coerce(value, hints[key], f"{section}.{key}"))
    return f"{section}.{key}"


def _parse_toml(text: str, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        # tomllib's message already carries "(at line L, column C)".
        raise ConfigError(f"{source} is not valid TOML: {err}.") from None
    except (ValueError, RecursionError) as err:  # an integer of 5000 digits; arrays nested too deeply
        why = "values nested too deeply" if isinstance(err, RecursionError) else str(err).split(":")[0]
        raise ConfigError(f"{source} is not a TOML file distft can read ({why}).") from None


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, run: bool = False
) -> Config:
    """Defaults, then the TOML file at `path`, then `section.key=value` overrides; validated.

    `run`: `path` is a run's saved config.toml, which `to_toml` writes whole: a section missing
    (an emptied or cut file) is damage, not a wish for the defaults."""
    cfg = Config()
    explicit: set[str] = set()  # the fields the file and the overrides set
    if path is not None:
        path = Path(path)
        if path.is_dir() or not path.exists():  # a pipe (`--config <(...)`) or /dev/null reads once, as asked
            what = "is a directory; give a TOML file" if path.is_dir() else "does not exist"
            raise ConfigError(f"Config file {path} {what}.")
        try:
            raw = path.read_bytes()
        except OSError as err:
            raise ConfigError(f"Config file {path} cannot be read ({err.strerror or err}).") from None
        data = _parse_toml(decode_utf8(raw, str(path), ConfigError), str(path))
        if run and (missing := [s for s in _SECTION_TYPES if s not in data and s not in _LATER_SECTIONS]):
            raise DamagedFileError(
                f"{path} has no [{'], ['.join(missing)}] section, which every run's config.toml holds: it is "
                "damaged, or not from distft. Restore it from a copy."
            )
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(
                    f"{path}: top-level key `{one_line(section)}` must be a [section] table"
                    + (f" ([{section}] then its keys)." if section in _SECTION_TYPES else ".")
                    + ("" if section in _SECTION_TYPES else nearest(section, list(_SECTION_TYPES)))
                )
            for key, value in table.items():
                explicit.add(_apply(cfg, section, key, value))
    for item in overrides or []:
        explicit.add(apply_override(cfg, item))
    if cfg.train.epochs > 0 and "train.max_steps" in explicit:
        raise ConfigError(
            f"train.epochs={cfg.train.epochs:g} and train.max_steps={cfg.train.max_steps} both set the "
            "length of the run: keep one (epochs: max_steps = ceil(epochs x rows / global_batch_size))."
        )
    if cfg.optim.warmup_ratio > 0 and "optim.warmup_steps" in explicit:
        raise ConfigError(
            f"optim.warmup_steps={cfg.optim.warmup_steps} and optim.warmup_ratio={cfg.optim.warmup_ratio:g} "
            "both set the warm-up: keep one (the ratio is a share of train.max_steps)."
        )
    check_fields(cfg)
    cfg.explicit = frozenset(explicit)  # what a default-deriving caller must leave alone
    return cfg


def apply_override(cfg: Config, item: str) -> str:
    """Apply one `section.key=value` (the value read as TOML when it parses as one); its dotted name."""
    dotted, sep, raw = item.partition("=")
    section, dot, key = dotted.strip().partition(".")
    if not sep or not dot or not key:
        raise ConfigError(
            f"Override `{one_line(item)}` must look like section.key=value, e.g. optim.lr=1e-4."
        )
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except (ValueError, RecursionError):  # TOMLDecodeError, or a value tomllib cannot hold
        value = raw  # a bare string such as train.method=full
    return _apply(cfg, section, key, value)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escaped(c: str) -> str:
    """One character of a TOML basic string: a quote, a backslash or a control character escaped
    (a raw one makes config.toml unreadable)."""
    if c in _ESCAPES:
        return _ESCAPES[c]
    return f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c


def override_value(value: Any) -> str:
    """`value` as an override writes it after `section.key=`: a boolean lowercase, the rest as printed."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + "".join(_escaped(c) for c in value) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table, its keys quoted
        return "{" + ", ".join(f"{toml_value(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def to_toml(cfg: Config) -> str:
    lines: list[str] = []
    for section in dataclasses.fields(cfg):
        lines.append(f"[{section.name}]")
        for key, value in dataclasses.asdict(getattr(cfg, section.name)).items():
            if section.name == "train" and key == "max_steps" and cfg.train.epochs > 0:
                continue  # derived from the epochs at set-up: not a setting of the run
            if section.name == "optim" and key == "warmup_steps" and cfg.optim.warmup_ratio > 0:
                continue  # the ratio counts: the steps follow from the run's length
            lines.append(f"{key} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def config_differences(a: Config, b: Config, ignore: tuple[str, ...] = ()) -> list[str]:
    """`section.key: a -> b` for every field that differs, skipping the dotted names in `ignore`."""
    db = dataclasses.asdict(b)
    return [
        f"{section}.{key}: {value!r} -> {db[section][key]!r}"
        for section, table in dataclasses.asdict(a).items()
        for key, value in table.items()
        if f"{section}.{key}" not in ignore and db[section][key] != value
    ]
