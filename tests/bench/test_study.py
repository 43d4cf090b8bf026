"""`distft bench --study`: interleaved repeats, spreads, verdicts, report and plot. Nothing is timed."""

import json

import pytest

from distft.bench import study
from distft.bench.spread import spread
from distft.bench.study import summarize
from distft.cli import main

CONFIGS = {"single": ("single", ()), "ok": ("ddp", ()), "bad": ("ddp", ("parallel.ddp_no_sync=false",))}


def _runs(times):
    return [{"step_time_s": t, "bytes": 8, "calls": 2, "comm_s": 0.1, "comm_exposed_s": 0.05,
             "overlap_fraction": 0.5} for t in times]  # fmt: skip


def test_spreads_and_verdicts_from_numbers():
    assert spread([1.0, 2.0, 3.0, 4.0]) == {"median": 2.5, "min": 1.0, "max": 4.0, "q1": 1.75, "q3": 3.25}
    rows = summarize(CONFIGS, {"single": _runs([2, 2.2]), "ok": _runs([1, 1.1]), "bad": _runs([1.5, 1.6])}, 2)
    by = {r["label"]: r for r in rows}
    assert by["ok"]["speedup"]["median"] == pytest.approx(2.1 / 1.05)
    assert by["bad"]["vs_correct"]["verdict"] == "slower"
    rows = summarize(CONFIGS, {"single": _runs([2]), "ok": _runs([1, 1.5]), "bad": _runs([1.2, 1.6])}, 2)
    assert rows[2]["vs_correct"]["verdict"] == "spreads overlap"  # no winner declared


def test_study_runs_interleaved_and_writes_its_report(tmp_path, monkeypatch):
    monkeypatch.setitem(
        study.STUDIES, "ddp-misconfig", {"single": ("single", ()), "ddp (correct)": ("ddp", ())}
    )
    out = tmp_path / "study"
    args = ["bench", "--study", "ddp-misconfig", "--repeats", "2", "--model", "micro", "--steps", "1",
            "--warmup", "1", "--global-batch", "4", "--micro-batch", "1", "--seq-len", "256", "--out", str(out),
            "data.max_rows=16"]  # fmt: skip
    assert main(args) == 0
    summary = json.loads((out / "study.json").read_text())
    assert [r["label"] for r in summary["rows"]] == ["single", "ddp (correct)"]
    for label, runs in summary["runs"].items():
        assert [r["repeat"] for r in runs] == [1, 2], label
        row = next(r for r in summary["rows"] if r["label"] == label)
        times = [r["step_time_s"] for r in runs]
        assert row["step_time_s"]["min"] == min(times) and row["step_time_s"]["max"] == max(times)
    ddp = summary["rows"][1]
    assert (
        ddp["bytes"] > 0
        and ddp["overlap_fraction"] is not None
        and 0 <= ddp["overlap_fraction"]["median"] <= 1
    )
    report = (out / "study.md").read_text()
    assert "| ddp (correct) |" in report and "![ddp-misconfig](study_ddp-misconfig.png)" in report
    assert (out / "study_ddp-misconfig.png").stat().st_size > 0
