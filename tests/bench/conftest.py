"""The bench's training runs, forked from the test server instead of started as new interpreters.

`distft bench` starts each `distft train` as a fresh `python -m distft.cli` (`harness.run_train`):
what a user measures includes the interpreter's start. The tests check the bench's machinery, not
that start, and a fresh interpreter costs ~5 s of CPU on the suite's 2 cores, so here the same
command runs forked from the server that imported distft once (`tests.helpers.run_cli`), with
the same arguments, environment and exit code. `tests/bench/test_startup.py` keeps real starts.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from distft.bench import harness
from tests.helpers import run_cli


def _forked_run(cmd, *args, env=None, **kwargs):
    if list(cmd[:3]) != [sys.executable, "-m", "distft.cli"]:
        return subprocess.run(cmd, *args, env=env, **kwargs)
    return run_cli(*cmd[3:], env=env, timeout=600)


# Module-scoped, so that a module's own fixtures (a sweep trained once for all its tests) fork
# their runs too: an autouse fixture is set up before the other fixtures of its scope.
@pytest.fixture(scope="module", autouse=True)
def forked_training_runs(request):
    if request.module.__name__.endswith("test_startup"):
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(harness, "subprocess", SimpleNamespace(run=_forked_run))  # the harness's only
        yield
