"""The overlap arithmetic of `distft.measure.overlap` on hand-made timelines (no process group)."""

import pytest

from distft.bench.predict import exposed_comm
from distft.measure.overlap import CommTimeline, intersect, subtract, union


def test_interval_algebra():
    assert union([[3, 4], [0, 1], [0.5, 2], [5, 5]]) == [[0, 2], [3, 4]]
    assert intersect([[0, 2], [3, 4]], [[1, 3.5]]) == [[1, 2], [3, 3.5]]
    assert subtract([[0, 10]], [[2, 3], [5, 6]]) == [[0, 2], [3, 5], [6, 10]]
    assert subtract([[0, 1]], [[-1, 2]]) == []


def test_summary_splits_communication_into_hidden_and_exposed():
    t = CommTimeline()
    s = t.start = t.start - 1.0  # a step that began a second ago
    t.compute = [[s + 0.0, s + 0.4]]  # compute, then a wait
    t.blocked = [[s + 0.5, s + 0.6]]
    t.comm = [[s + 0.3, s + 0.6]]  # 0.1 under compute, 0.2 not
    out = t.summary()
    assert out["comm_s"] == pytest.approx(0.3)
    assert out["comm_exposed_s"] == pytest.approx(0.2)
    assert out["overlap_fraction"] == pytest.approx(1 / 3)
    assert t.comm == [] and CommTimeline().summary()["overlap_fraction"] is None  # reset; none: null


def test_projection_uses_the_measured_overlap():
    assert exposed_comm(1.0, 5.0, 1.0) == 0.0  # all of it overlaps: hidden
    assert exposed_comm(1.0, 5.0, 0.25) == pytest.approx(0.75)  # measured: a quarter hidden
    assert exposed_comm(1.0, 0.1, 0.5) == pytest.approx(0.9)  # never more than the compute
    assert exposed_comm(2.0, 1.0, 0.0) == 2.0  # on the critical path: all of it shows
