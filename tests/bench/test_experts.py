"""`distft bench --experts` on the CPU at a tiny size: the record holds every method and
implementation, measured on a model whose experts ran the implementation named, their losses
agreeing with eager's; the report, the JSON and the manifest are written; bad options are refused
in one line before anything runs. Nothing here is timed: the figures' values are not checked."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from distft.bench import experts
from distft.cli import main
from distft.io.files import MANIFEST

STEPS = 2


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-experts")
    argv = ["bench", "--experts", "--micro-batch", "2", "--seq-len", "24", "--steps", str(STEPS),
            "--warmup", "0", "--out", str(out)]  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    return out, json.loads((out / "experts.json").read_text()), printed.getvalue()


def test_every_method_and_implementation_is_in_the_record(bench):
    out, record, printed = bench
    assert record["settings"]["model"] == "qwen3-moe-micro"
    assert (record["settings"]["micro_batch_size"], record["settings"]["seq_len"]) == (2, 24)
    assert [r["method"] for r in record["results"]] == ["lora", "full"]
    report = (out / "experts.md").read_text()
    assert report.startswith("## Grouped expert matmul\n")
    for result in record["results"]:
        assert result["layers"] == result["experts_modules"] == 4  # every layer's experts were timed
        rows = result["rows"]
        assert [r["implementation"] for r in rows] == list(experts.IMPLEMENTATIONS)
        eager = rows[0]
        assert eager["step_speedup"] == eager["experts_speedup"] == 1.0
        for row in rows:
            assert len(row["step_s"]) == STEPS  # and the experts timed several times each round
            assert len(row["experts_s"]) == STEPS * record["settings"]["experts_repeats"] > STEPS
            assert row["step_ms"] > 0 and row["experts_ms"] > 0 and row["tokens_per_s"] > 0
            # the same weights and batch: the implementations compute one loss
            assert row["loss"] == pytest.approx(eager["loss"], rel=experts.AGREEMENT)
            assert row["loss_rel_diff"] <= experts.AGREEMENT
            assert f"| {result['method']} | {row['implementation']} | {row['step_ms']:.1f} |" in report
            assert row["implementation"] in printed
    assert record["agrees"] is True
    target = record["target"]
    assert target["speedup"] == experts.TARGET and set(target["speedups"]) == {"lora", "full"}
    assert target["implementation"] == "grouped_lora"
    assert target["met"] == (min(target["speedups"].values()) >= experts.TARGET)
    assert ("**met**" in report) == target["met"] and ("**not met**" in report) != target["met"]
    assert set(json.loads((out / MANIFEST).read_text())["files"]) == {"experts.md", "experts.json"}
    assert printed.rstrip().endswith("experts.json")


@pytest.mark.parametrize(
    "flags, says, when",
    [
        (
            ["--strategies", "ddp"],
            "--experts times one model's experts in one process: drop --strategies",
            "parsed",
        ),
        (["--methods", "lora,qlora"], "--experts --methods takes lora and full, got qlora", "parsed"),
        (["--steps", "0"], "--experts needs at least one measured step, got --steps 0", "parsed"),
        (["model.experts_implementation=fast"], "`model.experts_implementation` is 'fast'", "built"),
        (["--model", "micro"], "--experts times a mixture of experts' layers, and micro has none", "built"),
    ],
)
def test_bad_options_refused_in_one_line_before_anything_runs(
    flags, says, when, tmp_path, monkeypatch, capsys
):
    """Refused when the flags are read, or when the first model is built (a setting, a dense
    model), before any round runs; nothing written."""

    def measured(*args, **kwargs):
        raise AssertionError("a round was run")

    if when == "parsed":
        monkeypatch.setattr(experts, "measure_method", measured)
    else:
        monkeypatch.setattr(experts, "time_step", measured)
    out = tmp_path / "out"
    assert main(["bench", "--experts", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
