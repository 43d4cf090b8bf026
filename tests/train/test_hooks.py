"""`DISTFT_HOOKS=module:function` (`distft.train.hooks.from_environment`): the one way hooks get
into `distft train` and `distft doctor` from outside, which is how the tests inject their faults
(`tests.faults`). Unset, nothing is installed; a name that does not resolve is one paragraph."""

from __future__ import annotations

import pytest

from distft.errors import ConfigError
from distft.train import TrainHooks
from distft.train.hooks import from_environment
from tests import faults


def not_hooks() -> str:
    return "hooks"


def test_unset_installs_nothing(monkeypatch):
    monkeypatch.delenv("DISTFT_HOOKS", raising=False)
    monkeypatch.setenv("DISTFT_FAULT_NAN_AT_STEP", "1")  # the faults' own variables alone do nothing
    assert from_environment() is None


def test_the_named_function_gives_the_hooks(monkeypatch):
    monkeypatch.setenv("DISTFT_HOOKS", faults.HOOKS)
    for name in faults.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert from_environment() is None  # tests.faults: no DISTFT_FAULT_* variable, no hooks
    monkeypatch.setenv("DISTFT_FAULT_NAN_AT_STEP", "3")
    hooks = from_environment()
    assert isinstance(hooks, TrainHooks) and hooks.after_backward is faults.poison_gradients


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("tests.no_such_module:hooks", "No module named 'tests.no_such_module'"),
        ("tests.faults:no_such_function", "has no attribute 'no_such_function'"),
        ("tests.faults", "has no attribute ''"),  # no colon: no function named
        (":hooks", "Empty module name"),
    ],
)
def test_a_name_that_does_not_resolve_is_a_config_error(monkeypatch, value, why):
    monkeypatch.setenv("DISTFT_HOOKS", value)
    with pytest.raises(ConfigError, match="names no function") as err:
        from_environment()
    assert why in str(err.value) and "give module:function" in str(err.value)


def test_a_function_that_returns_no_hooks_is_a_config_error(monkeypatch):
    monkeypatch.setenv("DISTFT_HOOKS", f"{__name__}:not_hooks")
    with pytest.raises(ConfigError, match="returned str, not TrainHooks or None"):
        from_environment()
