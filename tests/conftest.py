"""Fixtures shared across test files, and one setting for the whole suite."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from tests.helpers import PARITY, distft

# The CLI runs in subprocesses with OMP_NUM_THREADS=1 (tests/helpers.py); references trained in
# this process must sum in the same order, or a parity test compares 1-thread against 2-thread
# matmul rounding, which Adam amplifies past 1e-5 in near-zero adapter weights.
torch.set_num_threads(1)

# Property tests (tests/*/test_*_properties.py): a few seconds each. `CI=1` replays the same
# examples every run (derandomized); HYPOTHESIS_PROFILE=thorough hunts with 30x as many. No
# example database is written (tmp_path is function-scoped, but every example rewrites its file).
settings.register_profile(
    "distft",
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
settings.register_profile("ci", parent=settings.get_profile("distft"), derandomize=True)
settings.register_profile("thorough", parent=settings.get_profile("distft"), max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "distft"))


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The single-process run every parity test compares against (trained once per session)."""
    out = tmp_path_factory.mktemp("single")
    distft("train", *PARITY, "--out", str(out))
    return out
