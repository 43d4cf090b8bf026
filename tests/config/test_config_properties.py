"""Property tests: whatever a config file or an override says, loading it ends in a `Config` or
in a `ConfigError` (one paragraph, exit code 2 from the CLI), never in another exception; and a
config that loads passes through the strategy checks the same way and round-trips through
`to_toml`. Settings: the hypothesis profiles in tests/conftest.py."""

import dataclasses
import json
import math
import typing

from hypothesis import given
from hypothesis import strategies as st

from distft.config import Config, config_differences, load_config, to_toml
from distft.errors import ConfigError
from distft.parallel import STRATEGIES, check_config, ignored_settings

SECTIONS = {
    section.name: [f.name for f in dataclasses.fields(typing.get_type_hints(Config)[section.name])]
    for section in dataclasses.fields(Config)  # the TOML sections (not the class variables)
}
KEYS = [f"{section}.{key}" for section, keys in SECTIONS.items() for key in keys]
NAMES = st.sampled_from([*SECTIONS, *(k for ks in SECTIONS.values() for k in ks)]) | st.from_regex(
    r"[a-z_]{1,8}", fullmatch=True
)
EDGES = st.sampled_from([0, 1, -1, 2, 7, 2**63, -(2**63), 10**30, 0.5, 1.0, 1e-9, 1e300, -0.0])
NUMBERS = st.integers() | st.floats() | EDGES
CHOICES = st.sampled_from([*STRATEGIES, "lora", "qlora", "full", "true", "false", "auto", "micro", "layer"])
SCALARS = NUMBERS | st.booleans() | st.text(max_size=12) | CHOICES | st.datetimes()
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(NAMES, inner, max_size=2),
    max_leaves=6,
)


def toml_value(value) -> str:
    """`value` written as TOML (tomllib's types): what a user could have typed."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON's escapes are TOML's (a lone surrogate is refused: fine)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    return value.isoformat()  # a datetime


TABLES = st.dictionaries(
    NAMES,
    st.dictionaries(st.sampled_from([k for ks in SECTIONS.values() for k in ks]) | NAMES, VALUES, max_size=4),
    max_size=3,
)
TOML = TABLES.map(
    lambda tables: "".join(
        f"[{section}]\n" + "".join(f"{key} = {toml_value(v)}\n" for key, v in table.items())
        for section, table in tables.items()
    )
)
OVERRIDES = st.lists(
    st.builds(
        lambda key, value: f"{key}={value}",
        st.sampled_from(KEYS) | NAMES,
        VALUES.map(toml_value) | st.text(max_size=12),
    ),
    max_size=4,
)


def load_or_refuse(path=None, overrides=()) -> Config | None:
    """The config, its strategy checked, or None after a one-paragraph ConfigError."""
    try:
        cfg = load_config(path, list(overrides))
        check_config(cfg)
    except ConfigError as err:
        assert "\n" not in str(err).strip(), err
        return None
    assert all("\n" not in line for line in ignored_settings(cfg))
    return cfg


def assert_round_trips(cfg: Config, tmp_path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg), encoding="utf-8")
    assert config_differences(cfg, load_config(path)) == []


@given(data=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_any_bytes_load_or_refuse(tmp_path, data):
    path = tmp_path / "run.toml"
    path.write_bytes(data)
    load_or_refuse(path)


@given(text=TOML, tail=st.sampled_from(["", "\n[", "\nx = ", "\n\x00", "\n" + "[" * 3000]))
def test_any_toml_loads_or_refuses(tmp_path, text, tail):
    path = tmp_path / "run.toml"
    path.write_text(text + tail, encoding="utf-8", errors="surrogatepass")
    cfg = load_or_refuse(path)
    if cfg is not None:
        assert_round_trips(cfg, tmp_path)


@given(overrides=OVERRIDES)
def test_any_overrides_load_or_refuse(tmp_path, overrides):
    cfg = load_or_refuse(None, overrides)
    if cfg is not None:
        assert_round_trips(cfg, tmp_path)


@given(values=st.dictionaries(st.sampled_from(KEYS), NUMBERS, min_size=1, max_size=3))
def test_any_numbers_load_or_refuse(tmp_path, values):
    """Numbers alone, in every numeric setting (the other kinds are refused by type first)."""
    cfg = load_or_refuse(None, [f"{key}={toml_value(v)}" for key, v in values.items()])
    if cfg is not None:
        assert_round_trips(cfg, tmp_path)


@given(text=st.text(max_size=40))
def test_any_text_setting_round_trips(tmp_path, text):
    """A system prompt or instruction of any characters (a tab, a carriage return, an escape
    character) is written to config.toml so that it reads back the same."""
    cfg = Config()
    cfg.data.system_prompt, cfg.data.instruction = text, text[::-1]
    assert_round_trips(cfg, tmp_path)
