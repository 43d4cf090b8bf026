"""Every numeric setting has a range (`distft.config.RANGES`), checked when a config loads: the
key and the range named, NaN and infinities refused everywhere."""

import dataclasses
import math
import re
import typing
from pathlib import Path

import pytest

from distft.config import RANGES, Config, Range, load_config
from distft.errors import ConfigError

TYPES = {
    f"{section.name}.{key}": annotation
    for section in dataclasses.fields(Config)  # the TOML sections (not the class variables)
    for key, annotation in typing.get_type_hints(typing.get_type_hints(Config)[section.name]).items()
}
NUMERIC = [key for key, annotation in TYPES.items() if annotation in (int, float)]
FLOATS = [key for key, annotation in TYPES.items() if annotation is float]


def test_every_numeric_setting_has_a_range():
    assert sorted(RANGES) == sorted(NUMERIC)


def test_the_defaults_are_in_range():
    cfg = Config()
    for key, allowed in RANGES.items():
        section, name = key.split(".")
        assert getattr(getattr(cfg, section), name) in allowed, key


@pytest.mark.parametrize("key", FLOATS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_nan_and_infinities_are_refused_everywhere(key, value):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}={value}"])
    assert str(err.value).startswith(f"`{key}` must be a finite number"), err.value


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.lr=0", "`optim.lr` must be positive, got 0.0 (range: > 0)."),
        ("optim.lr=-1e-4", "`optim.lr` must be positive, got -0.0001 (range: > 0)."),
        ("optim.eps=0", "`optim.eps` must be positive, got 0.0 (range: > 0)."),
        ("optim.beta1=-0.1", "`optim.beta1` cannot be negative, got -0.1 (range: [0, 1))."),
        ("optim.beta2=1", "`optim.beta2` must be below 1, got 1.0 (range: [0, 1))."),
        ("optim.weight_decay=-0.01", "`optim.weight_decay` cannot be negative, got -0.01 (range: >= 0)."),
        ("optim.grad_clip=-1", "`optim.grad_clip` cannot be negative, got -1.0 (range: >= 0)."),
        ("optim.min_lr_ratio=1.5", "`optim.min_lr_ratio` must be at most 1, got 1.5 (range: [0, 1])."),
        ("optim.warmup_steps=-1", "`optim.warmup_steps` cannot be negative, got -1 (range: >= 0)."),
        ("lora.dropout=1", "`lora.dropout` must be below 1, got 1.0 (range: [0, 1))."),
        ("lora.alpha=0", "`lora.alpha` must be positive, got 0.0 (range: > 0)."),
        ("dpo.max_prompt_length=-1", "`dpo.max_prompt_length` cannot be negative, got -1 (range: >= 0)."),
        (
            "dpo.max_completion_length=-8",
            "`dpo.max_completion_length` cannot be negative, got -8 (range: >= 0).",
        ),
        (
            "data.validation_fraction=1",
            "`data.validation_fraction` must be below 1, got 1.0 (range: (0, 1)).",
        ),
        ("data.max_length=31", "`data.max_length` must be at least 32, got 31 (range: >= 32)."),
        ("train.micro_batch_size=0", "`train.micro_batch_size` must be positive, got 0 (range: >= 1)."),
        ("parallel.health_slow_s=0", "`parallel.health_slow_s` must be positive, got 0.0 (range: > 0)."),
        (
            "parallel.timeout_s=31536001",
            "`parallel.timeout_s` must be at most 31536000, got 31536001 (range: [1, 31536000]).",
        ),
        (
            "parallel.ddp_bucket_mb=0",
            "`parallel.ddp_bucket_mb` must be positive, got 0.0 (range: (0, 1000000]).",
        ),
        ("model.quant_block_size=1", "`model.quant_block_size` must be at least 2, got 1 (range: >= 2)."),
        ("train.seed=-1", "`train.seed` cannot be negative, got -1 (range: [0, 4294967295])."),
        (
            "train.seed=4294967296",
            "`train.seed` must be at most 4294967295, got 4294967296 (range: [0, 4294967295]).",
        ),
        (
            "train.max_steps=9223372036854775808",
            "`train.max_steps` must be at most 9223372036854775807 (2**63 - 1)",
        ),
        ("optim.lr=1" + "0" * 400, "`optim.lr` must be a finite number, got 1000"),
        (
            "data.validation_fraction=0",
            "`data.validation_fraction` must be positive, got 0.0 (range: (0, 1)).",
        ),
        ("parallel.timeout_s=0", "`parallel.timeout_s` must be positive, got 0 (range: [1, 31536000])."),
    ],
)
def test_out_of_range_names_the_key_and_the_range(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value).startswith(message), err.value


@pytest.mark.parametrize(
    "override",
    ["optim.lr=1e-6", "optim.beta2=0", "lora.dropout=0.999", "optim.grad_clip=0", "data.max_length=32"],
)
def test_the_edges_of_a_range_load(override):
    load_config(None, [override])


def test_a_range_refuses_nan_by_what_must_hold():
    for allowed in (Range(0), Range(0, low_open=True), Range(0, 1), Range(0, 1, high_open=True)):
        assert math.nan not in allowed and math.inf not in allowed and -math.inf not in allowed
        assert 0.5 in allowed


def test_docs_list_every_range():
    """docs/reliability.md's table of ranges says what `RANGES` says, setting by setting."""
    doc = (Path(__file__).parents[2] / "docs" / "reliability.md").read_text(encoding="utf-8")
    table = doc.split("### Ranges of numeric settings")[1].split("\n\n")[2]
    documented = {
        key: bound.strip()
        for bound, keys in (line.split("|")[1:3] for line in table.splitlines()[2:])
        for key in re.findall(r"`([a-z_]+\.[a-z_0-9]+)`", keys)
    }
    assert documented == {key: str(allowed) for key, allowed in RANGES.items()}
