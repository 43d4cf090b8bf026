"""`distft bench --seq-sweep` on the CPU: one real sweep of `micro` (2 levers x 2 lengths, one step
each) for the table, the doubling, the measured activations and the plot; bad options refused
before anything runs; and an out-of-memory ending, on fabricated figures. Nothing here is timed."""

import contextlib
import io
import json

import pytest

from distft.bench import seq_sweep
from distft.bench.seq_report import plot_seq_sweep, render
from distft.cli import main
from distft.io.files import MANIFEST


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-seq")
    argv = ["bench", "--seq-sweep", "--model", "micro", "--strategies", "single", "--seq-levers", "none,full,offload",
            "--seq-start", "256", "--seq-max", "512", "--steps", "1", "--warmup", "0", "--out", str(out)]  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    return out, json.loads((out / "results.json").read_text()), printed.getvalue()


def test_every_strategy_lever_and_doubled_length_measured(sweep):
    out, results, printed = sweep
    assert results["lengths"] == [256, 512]
    points = {(p["strategy"], p["lever"], p["length"]): p for p in results["points"]}
    # offload is full on the CPU: skipped, and the report says so.
    assert set(points) == {("single", lever, n) for lever in ("none", "full") for n in (256, 512)}
    report = (out / "report.md").read_text()
    assert "offload skipped: on the CPU" in report and printed.startswith(
        "bench --seq-sweep: single, none, 256"
    )
    for (strategy, lever, n), p in points.items():
        assert p["result"] == "fits" and p["mfu"] is None and p["peak_mem_bytes"] is None  # the CPU
        assert p["tokens_per_step"] == n  # one sequence a step, every row filled to the length
        assert f"| {strategy} | {lever} | {n} | {n} |" in report
        assert p["activations_predicted"] > 0
    for lever in ("none", "full"):  # more tokens keep more, measured and planned
        for key in ("activations_measured", "activations_predicted"):
            assert points["single", lever, 512][key] > points["single", lever, 256][key], (lever, key)
    for n in (256, 512):  # full checkpointing keeps less than none at the same length
        for key in ("activations_measured", "activations_predicted"):
            assert points["single", "full", n][key] < points["single", "none", n][key], (n, key)
    assert "Tokens per step equal sequences x length in every run that fit: **yes**" in report
    ends = {(r["strategy"], r["lever"]): r for r in results["series"]}
    assert ends["single", "none"]["longest_fit"] == 512
    assert "- single, full: longest that fit 512; reached --seq-max 512 (the CPU: nothing" in report
    for name in ("seq_sweep.png", "report.md", "results.json"):
        assert (out / name).stat().st_size > 0
        assert name in json.loads((out / MANIFEST).read_text())["files"]
    assert printed.rstrip().endswith("seq_sweep.png")


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--seq-start", "0"], "--seq-start must be at least 256, got 0"),
        (["--seq-start", "1024", "--seq-max", "512"], "--seq-start 1024 is above --seq-max 512"),
        (["--seq-max", "8192"], "--seq-max 8192 is past the 4,096 positions micro reaches"),
        (["--seq-levers", "full,partial"], "--seq-levers: 'partial' is not a lever"),
        (["--seq-levers", "none+tiles1"], "--seq-levers: 'none+tiles1' is not a lever"),
        (["--strategies", "tp-sp", "--seq-levers", "selective"], "--strategy tp-sp recomputes whole layers"),
        (["--seq-len", "512"], "--seq-sweep runs its own lengths and nothing else: drop --seq-len"),
    ],
)
def test_bad_options_refused_in_one_line_before_anything_runs(flags, says, tmp_path, monkeypatch, capsys):
    def launched(*args, **kwargs):
        raise AssertionError("a run was launched")

    monkeypatch.setattr(seq_sweep, "run_strategy", launched)
    out = tmp_path / "out"
    argv = ["bench", "--seq-sweep", "--model", "micro", "--strategies", "single", "--out", str(out), *flags]
    assert main(argv) == 2  # a repeated flag: the last one counts
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def _point(lever: str, length: int, result: str = "fits") -> dict:
    p = {"strategy": "single", "lever": lever, "length": length, "result": result}
    if result != "fits":
        return p | {
            "error": f"single-{lever}-{length} failed (exit 1): torch.OutOfMemoryError: CUDA out of memory."
        }
    return p | {"tokens_per_step": length, "expected_tokens_per_step": length, "tokens_per_s": 9e4 / length,
                "mfu": 0.3, "peak_mem_bytes": length * 2**20, "activations_measured": length * 2**19,
                "activations_predicted": length * 2**19}  # fmt: skip


def test_out_of_memory_ends_a_series_and_shows_in_the_table_and_the_plot(tmp_path):
    assert seq_sweep.ending("...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB") == (
        "out of memory"
    )
    assert seq_sweep.ending("ValueError: something else") == "failed"
    points = [
        _point("none", 1024),
        _point("none", 2048, "out of memory"),
        _point("full", 1024),
        _point("full", 2048),
    ]
    assert seq_sweep.series_end(points[:2], 2048, cuda=True) == "out of memory at 2,048"
    series = [{"strategy": "single", "lever": "none", "longest_fit": 1024, "stopped": "out of memory at 2,048"},
              {"strategy": "single", "lever": "full", "longest_fit": 2048, "stopped": "reached --seq-max 2,048"}]  # fmt: skip
    settings = seq_sweep.SeqSweepSettings(["single"], ["none", "full"], seq_start=1024, seq_max=2048)
    summary = {"settings": settings.__dict__, "environment": {"device": "NVIDIA H100", "torch": "2.x", "cpu_count": 16},
               "notes": [], "label_tokens": 200, "lengths": [1024, 2048], "points": points, "series": series,
               "failures": {}}  # fmt: skip
    report = render(summary)
    assert "| single | none | 2,048 | - | - | - | - | - | - | - | **out of memory** |" in report
    assert "| single | full | 2,048 | 2,048 | 44 | 30.0% | 2,048.0 MiB |" in report
    assert "- single, none: longest that fit 1,024; out of memory at 2,048" in report
    fig = plot_seq_sweep(summary, tmp_path / "seq_sweep.png")
    memory, throughput = fig.axes
    oom = [line for line in memory.get_lines() if line.get_marker() == "x"]
    assert len(oom) == 1 and list(oom[0].get_xdata()) == [2048]
    for ax in (memory, throughput):
        assert ax.get_xscale() == "log" and ax.get_ylim()[0] == 0
    assert "peak memory" in memory.get_ylabel() and throughput.get_legend() is not None
