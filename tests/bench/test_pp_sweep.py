"""`--pp-splits`: the cuts the pipeline sweep runs, parsed and checked before anything runs."""

import json

import pytest

from distft.bench import harness
from distft.bench.harness import BenchSettings
from distft.bench.pp_sweep import check_split_stages, parse_splits, run_name, split_override, sweep_losses
from distft.cli import build_parser, main
from distft.errors import ConfigError


def test_splits_parse_by_name_or_layers_per_stage():
    assert build_parser().parse_args(["bench", "--pp-sweep"]).pp_splits == "balanced,even"  # the default
    assert parse_splits("balanced,even") == ["balanced", "even"]
    assert parse_splits(" even , 03-1,even") == ["even", "3-1"]  # spaces, leading zeros, repeats
    assert split_override("balanced") == "parallel.pp_split=balanced"
    assert split_override("3-1") == "parallel.pp_split=[3,1]"  # a TOML list, as the config reads it
    for bad in ("lopsided", "3", "3-0", "3-x", "-3-1", ",", ""):
        with pytest.raises(ConfigError, match="--pp-splits"):
            parse_splits(bad)


def test_a_bad_split_is_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "--pp-sweep", "1f1b", "--pp-splits", "balanced,lopsided", "--out", str(out)]) == 2
    assert "'lopsided' is not a split" in capsys.readouterr().err
    # An explicit cut must have the stages of every schedule swept: zbv has 2 per rank, 4 on 2 ranks.
    assert main(["bench", "--pp-sweep", "1f1b,zbv", "--pp-splits", "3-1", "--out", str(out)]) == 2
    assert "cuts 2 stages" in capsys.readouterr().err and not out.exists()


def test_explicit_cuts_match_the_stages_of_each_schedule():
    check_split_stages(["balanced", "3-1"], ["gpipe", "1f1b", "zero-bubble"], 2, [])
    check_split_stages(["1-1-1-1"], ["interleaved-1f1b", "zbv"], 2, [])
    with pytest.raises(ConfigError, match=r"interleaved-1f1b 4"):
        check_split_stages(["3-1"], ["1f1b", "interleaved-1f1b"], 2, [])
    check_split_stages(["3-1"], ["zbv"], 2, ["parallel.stages_per_rank=1"])  # V given: the run checks


def test_runs_are_named_by_their_split_and_older_ones_without():
    assert run_name("zbv", 4, "balanced") == "pp-zbv-m4-balanced"
    old, new = {"schedule": "1f1b", "microbatches": 2, "losses": [1.0]}, {"split": "3-1"}
    assert sweep_losses([old, {**old, **new}]) == {"pp-1f1b-m2": [1.0], "pp-1f1b-m2-3-1": [1.0]}


def test_the_sweep_runs_each_cell_with_its_split_and_keeps_the_modelled_figures(tmp_path, monkeypatch):
    """`run_pp_sweep` with `distft train` replaced by a stand-in that writes a run's files."""
    calls = []

    def fake_train(argv: list[str], out) -> float:
        calls.append(argv)
        out.mkdir(parents=True)
        records = [{"step_time_s": 1.0 + i / 10, "tokens_per_s": 100.0, "tokens": 512, "loss": 2.0,
                    "idle_fraction": 0.4 + i / 100, "idle_fraction_theory": 0.33, "idle_fraction_modelled": 0.35,
                    "stage_imbalance": None if i == 1 else 1.3, "stage_imbalance_modelled": 1.2}
                   for i in range(3)]  # fmt: skip
        (out / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)))
        (out / "ranks.json").write_text("[]")
        timeline = {
            "layers_per_stage": [3, 1],
            "idle_fraction_replayed": 0.39,
            "idle_fraction_imbalance_floor": 0.3,
        }
        (out / "pipeline_timeline.json").write_text(json.dumps(timeline))
        return 1.0

    monkeypatch.setattr(harness, "run_train", fake_train)
    settings = BenchSettings(strategies=["pp"], steps=2, warmup=1, pp_schedules=["1f1b"], pp_microbatches=[2],
                             pp_splits=["balanced", "3-1"])  # fmt: skip
    sweep, failures = harness.run_pp_sweep(settings, tmp_path)
    assert not failures and [s["split"] for s in sweep] == ["balanced", "3-1"]
    assert [c[-1] for c in calls] == ["parallel.pp_split=balanced", "parallel.pp_split=[3,1]"]
    assert (tmp_path / "runs" / "pp-1f1b-m2-3-1" / "metrics.jsonl").exists()
    cell = sweep[1]  # medians over the 2 measured steps; a step without an imbalance is left out
    assert cell["idle_fraction"] == pytest.approx(0.415) and cell["idle_fraction_modelled"] == 0.35
    assert cell["stage_imbalance"] == 1.3 and cell["stage_imbalance_modelled"] == 1.2
    assert cell["layers_per_stage"] == [3, 1] and cell["idle_fraction_replayed"] == 0.39
    assert cell["step_time_s"] == {"median": pytest.approx(1.15), "min": 1.1, "max": 1.2}
