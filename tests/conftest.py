"""Fixtures shared across test files."""

import pytest

from tests.helpers import PARITY, distft


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The single-process run every parity test compares against (trained once per session)."""
    out = tmp_path_factory.mktemp("single")
    distft("train", *PARITY, "--out", str(out))
    return out
