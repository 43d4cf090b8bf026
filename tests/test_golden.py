"""Each path without an outside reference trains its fixed micro run to the committed per-step
losses and gradient norms (tests/golden.py says which paths, why, and how the file is rewritten)."""

from __future__ import annotations

import pytest

from tests.golden import FIELDS, RTOL, RUNS, STEPS, read, train


def test_the_file_holds_every_run_and_no_other():
    golden = read()
    assert set(golden) == set(RUNS)
    assert all(len(steps) == STEPS and all(set(s) == set(FIELDS) for s in steps) for steps in golden.values())


@pytest.mark.parametrize("name", RUNS)
def test_trains_to_the_golden_losses(name, tmp_path):
    got, want = train(name, tmp_path), read()[name]
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=1):
        for field in FIELDS:
            assert g[field] == pytest.approx(w[field], rel=RTOL), (name, step, field, g[field], w[field])
