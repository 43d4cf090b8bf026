"""Fixtures shared across test files, and one setting for the whole suite."""

import pytest
import torch

from tests.helpers import PARITY, distft

# The CLI runs in subprocesses with OMP_NUM_THREADS=1 (tests/helpers.py); references trained in
# this process must sum in the same order, or a parity test compares 1-thread against 2-thread
# matmul rounding, which Adam amplifies past 1e-5 in near-zero adapter weights.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The single-process run every parity test compares against (trained once per session)."""
    out = tmp_path_factory.mktemp("single")
    distft("train", *PARITY, "--out", str(out))
    return out
