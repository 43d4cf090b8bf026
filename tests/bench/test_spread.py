"""Repeats in `distft bench`: spreads, honest rankings, interleaving. Synthetic records, no runs."""

import json

import pytest

from distft.bench import harness
from distft.bench.harness import BenchSettings, StrategyResult, combine_repeats, run_bench
from distft.bench.report import write_report
from distft.bench.spread import compare, rank, ranking_sentence, spread


def _range(lo: float, hi: float) -> dict:
    return spread([lo, (lo + hi) / 2, hi])


def test_compare_orders_only_separate_ranges():
    assert compare(_range(3, 4), _range(1, 2)) == "above"
    assert compare(_range(1, 2), _range(3, 4)) == "below"
    assert compare(_range(1, 3), _range(2, 4)) == "overlap"
    assert compare(_range(1, 2), _range(2, 3)) == "overlap"  # touching ends: not separated


def test_rank_declares_a_winner_only_when_its_range_clears_the_rest():
    clear = {"single": _range(700, 800), "ddp": _range(1500, 1600), "fsdp": _range(1000, 1400)}
    r = rank(clear)
    assert r["order"] == ["ddp", "fsdp", "single"] and r["winner"] == "ddp" and r["leaders"] == ["ddp"]
    assert r["chain"] == "ddp > fsdp > single"
    assert ranking_sentence(clear, "tokens/s").startswith("**ddp** has the best tokens/s")

    close = {**clear, "zero2": _range(1350, 1550)}  # overlaps ddp's range and fsdp's
    r = rank(close)
    assert r["winner"] is None and r["leaders"] == ["ddp", "zero2"]
    assert r["chain"] == "ddp ~ zero2 ~ fsdp > single"
    sentence = ranking_sentence(close, "tokens/s")
    assert "No winner on tokens/s: the min-max ranges of ddp and zero2 overlap" in sentence
    assert "**" not in sentence

    # Lower is better for step times: the same ranges, the other way round.
    assert rank({"a": _range(1, 2), "b": _range(3, 4)}, higher_is_better=False)["chain"] == "a > b"
    assert ranking_sentence({"only": _range(1, 2)}, "tokens/s") == ""  # nothing to rank


def _result(strategy: str, tokens_per_s: float, losses=(2.0, 1.5), overlap=None) -> StrategyResult:
    steps = [tokens_per_s * 0.9, tokens_per_s, tokens_per_s * 1.1]
    extra = (
        {}
        if overlap is None
        else {"comm_s": 0.01, "comm_exposed_s": 0.01 * (1 - overlap), "overlap_fraction": overlap}
    )
    return StrategyResult(
        strategy=strategy, world_size=1 if strategy == "single" else 2, wall_s=5.0,
        step_time_s=spread([100 / t for t in steps]), tokens_per_s=spread(steps), losses=list(losses),
        ranks=[{"rank": 0, "peak_mem_bytes": 1, "saved_activation_bytes": 1}], comm_bytes={},
        comm_bytes_expected={}, tokens_per_step=100.0, extra=extra,
    )  # fmt: skip


def test_combine_repeats_spreads_the_runs_medians():
    runs = [_result("ddp", t, overlap=o) for t, o in ((1000, 0.1), (1200, 0.3), (900, 0.2))]
    combined = combine_repeats(runs)
    assert combined.tokens_per_s == {"median": 1000, "min": 900, "max": 1200}
    assert [r["tokens_per_s"]["median"] for r in combined.repeats] == [1000, 1200, 900]
    assert combined.extra["overlap_fraction"] == pytest.approx(0.2)
    assert combined.extra["overlap_fraction_range"] == pytest.approx([0.1, 0.3])
    assert combined.extra["repeat_loss_max_relative_difference"] == 0.0
    assert combined.losses == runs[0].losses
    drifted = combine_repeats([runs[0], _result("ddp", 1000, losses=(2.0, 1.515))])
    assert drifted.extra["repeat_loss_max_relative_difference"] == pytest.approx(0.01)
    assert combine_repeats(runs[:1]) is runs[0]  # one run: its own steps' spread, unchanged


def test_bench_interleaves_repeats_and_reports_spreads(tmp_path, monkeypatch):
    calls = []
    speeds = {"single": [800, 700, 750], "ddp": [1500, 1300, 1400], "zero2": [1450, 1600, 1200]}

    def fake_run(settings, strategy, out, extra=()):
        calls.append(out.name)
        out.mkdir(parents=True)
        (out / "config.toml").write_text("[model]\n")
        return _result(
            strategy, speeds[strategy][sum(c.startswith(strategy) for c in calls) - 1], overlap=0.25
        )

    monkeypatch.setattr(harness, "run_strategy", fake_run)
    monkeypatch.setattr(harness, "time_plain_loop", lambda s: {"step_time_s": {"median": 1.0}})
    settings = BenchSettings(strategies=["single", "ddp", "zero2"], model="micro", repeats=3)
    summary = run_bench(settings, tmp_path)
    # Interleaved: every strategy once per round, later rounds in their own directories.
    assert calls == [
        "single",
        "ddp",
        "zero2",
        "single-r2",
        "ddp-r2",
        "zero2-r2",
        "single-r3",
        "ddp-r3",
        "zero2-r3",
    ]
    by = {r["strategy"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    assert by["ddp"]["tokens_per_s"] == {"median": 1400, "min": 1300, "max": 1500}
    assert len(by["zero2"]["repeats"]) == 3
    report = write_report(summary, tmp_path).read_text()
    assert "median [min-max] over 3 interleaved runs" in report
    assert "| ddp | 2 |" in report and "| 1,400 [1,300-1,500] |" in report
    assert "No winner on tokens/s: the min-max ranges of zero2 and ddp overlap" in report
    assert "zero2 ~ ddp > single" in report  # zero2 has the higher median
    assert (
        "every strategy's 3 runs gave the same losses (largest relative difference between a repeat and its first run 0.0e+00)"
        in report
    )
    # Overlap measured for the communicating strategies, with its range over the runs.
    assert "## Communication time and overlap (measured)" in report
    assert "| ddp | 10.0 [10.0-10.0] | 7.5 [7.5-7.5] | 25% [25%-25%] |" in report
