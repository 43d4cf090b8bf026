"""`distft bench` machinery: files, figures, and the loss-agreement check. Nothing here is timed."""

import dataclasses
import json
import math

import pytest

from distft.bench.harness import loss_agreement
from distft.cli import main


def _finite_numbers(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _finite_numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _finite_numbers(v)
    elif isinstance(obj, int | float) and not isinstance(obj, bool):
        yield obj


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    args = ["bench", "--strategies", "single,ddp", "--model", "micro", "--steps", "2", "--warmup", "1",
            "--global-batch", "4", "--seq-len", "256", "--out", str(out), "data.max_rows=16"]  # fmt: skip
    assert main(args) == 0
    return out, json.loads((out / "results.json").read_text())


def test_writes_report_results_and_plots(bench):
    out, _results = bench
    for name in ("report.md", "results.json", "throughput.png", "memory.png", "comm.png", "losses.png"):
        assert (out / name).stat().st_size > 0, name
    report = (out / "report.md").read_text()
    assert "| single | 1 |" in report and "| ddp | 2 |" in report
    assert "ddp: agrees" in report


def test_every_figure_is_present_and_finite(bench):
    _, results = bench
    assert results["environment"]["torch"] and results["config"].startswith("[model]")
    by_name = {r["strategy"]: r for r in results["results"]}
    assert set(by_name) == {"single", "ddp"}
    for r in by_name.values():
        assert r["step_time_s"]["median"] > 0 and r["tokens_per_s"]["median"] > 0
        assert len(r["losses"]) == 3 and len(r["ranks"]) == r["world_size"]
        assert all(rank["peak_mem_bytes"] > 0 and rank["saved_activation_bytes"] > 0 for rank in r["ranks"])
    assert by_name["ddp"]["comm_bytes"] == by_name["ddp"]["comm_bytes_expected"] != {}
    assert results["overhead_ratio"] > 0
    assert all(math.isfinite(x) for x in _finite_numbers(results))


def test_loss_agreement_catches_a_planted_divergence(bench):
    from distft.bench.harness import StrategyResult

    _, results = bench
    runs = [StrategyResult(**r) for r in results["results"]]
    assert all(a["agrees"] for a in loss_agreement(runs).values())
    planted = dataclasses.replace(runs[1], losses=[*runs[1].losses[:-1], runs[1].losses[-1] * 1.01])
    verdict = loss_agreement([runs[0], planted])
    assert verdict["single"]["agrees"] and not verdict["ddp"]["agrees"]
