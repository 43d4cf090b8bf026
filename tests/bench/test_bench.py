"""`distft bench` machinery: files, figures, and the loss-agreement check. Nothing here is timed."""

import dataclasses
import itertools
import json
import math

import pytest

from distft.bench.harness import loss_agreement
from distft.bench.report import comm_section, routed_match
from distft.cli import main
from distft.io.files import MANIFEST, damage
from tests.bench.fabricated import timeline_1f1b


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
            "--global-batch", "4", "--seq-len", "256", "--project", "2xrtx4090-pcie", "--out", str(out),
            "data.max_rows=16"]  # fmt: skip
    assert main(args) == 0
    return out, json.loads((out / "results.json").read_text())


def test_writes_report_results_and_plots(bench):
    out, _results = bench
    names = ("report.md", "results.json", "throughput.png", "memory.png", "comm.png", "losses.png")
    for name in names:
        assert (out / name).stat().st_size > 0, name
    # Each written atomically (no temporary left), and sealed by a manifest that finds a damaged copy.
    assert not list(out.glob(".*tmp*"))
    assert set(names) <= set(json.loads((out / MANIFEST).read_text())["files"]) and damage(out) is None
    plot = (out / "comm.png").read_bytes()
    (out / "comm.png").write_bytes(b"")
    assert damage(out).startswith("comm.png has 0 bytes")
    (out / "comm.png").write_bytes(plot)  # the fixture is shared
    report = (out / "report.md").read_text()
    assert "| single | 1 |" in report and "| ddp | 2 |" in report
    assert "ddp: agrees" in report
    assert "## Memory by component: measured vs `distft plan`" in report
    # Projected figures live in their own, labelled section, after every measured one.
    projected = report.index("## Projected (not measured)")
    assert "### projected: 2xrtx4090-pcie" in report[projected:]
    assert "## Do they train the same thing?" in report[:projected]
    assert 'The blog series\' claim "DDP near 2x on 2 GPUs"' in report[projected:]


def test_every_figure_is_present_and_finite(bench):
    _, results = bench
    assert results["environment"]["torch"] and results["config"].startswith("[model]")
    by_name = {r["strategy"]: r for r in results["results"]}
    assert set(by_name) == {"single", "ddp"}
    for r in by_name.values():
        assert r["step_time_s"]["median"] > 0 and r["tokens_per_s"]["median"] > 0
        assert len(r["losses"]) == 3 and len(r["ranks"]) == r["world_size"]
        assert all(rank["peak_mem_bytes"] > 0 and rank["saved_activation_bytes"] > 0 for rank in r["ranks"])
        # LoRA: adapters' gradients (fp32) and AdamW's two moments per adapter element, plus a step each.
        for rank in r["ranks"]:
            assert rank["grad_bytes"] > 0 and rank["optimizer_bytes"] >= 2 * rank["grad_bytes"]
        assert r["tokens_per_step"] > 0 and r["comm_calls"] == (
            {} if r["strategy"] == "single" else r["comm_calls"]
        )
    assert by_name["ddp"]["comm_bytes"] == by_name["ddp"]["comm_bytes_expected"] != {}
    assert results["overhead_ratio"] > 0
    # The plan's prediction of the same settings: state bytes exact (LoRA on the CPU, fp32).
    plan = results["plan_memory"]["strategies"]
    for name in ("single", "ddp"):
        rank0 = by_name[name]["ranks"][0]
        assert (
            plan[name]["grads"] == rank0["grad_bytes"] and plan[name]["optimizer"] == rank0["optimizer_bytes"]
        )
        assert plan[name]["params"] == sum(rank0["param_bytes"].values()) and plan[name]["activations"] > 0
    (projection,) = results["projections"]
    assert projection["profile"] == "2xrtx4090-pcie" and projection["winner"] in by_name
    assert set(projection["strategies"]) == {"single", "ddp"}
    assert [c["claim"] for c in projection["claims"]] == ["DDP near 2x on 2 GPUs"]
    assert all(math.isfinite(x) for x in _finite_numbers(results))


def test_loss_agreement_catches_a_planted_divergence(bench):
    from distft.bench.harness import StrategyResult

    _, results = bench
    runs = [StrategyResult(**r) for r in results["results"]]
    assert all(a["agrees"] for a in loss_agreement(runs).values())
    planted = dataclasses.replace(runs[1], losses=[*runs[1].losses[:-1], runs[1].losses[-1] * 1.01])
    verdict = loss_agreement([runs[0], planted])
    assert verdict["single"]["agrees"] and not verdict["ddp"]["agrees"]
    # The pipeline sweep's runs are checked the same way, by name.
    verdict = loss_agreement(runs, others={"pp-1f1b-m4": runs[1].losses, "pp-zbv-m4": planted.losses})
    assert verdict["pp-1f1b-m4"]["agrees"] and not verdict["pp-zbv-m4"]["agrees"]


# ---- projection and pipeline plots, on fabricated inputs (no runs) -------------------------


@pytest.mark.parametrize("mode", [[], ["--seq-sweep"]])
def test_an_empty_strategy_list_is_named(mode, capsys):
    assert main(["bench", *mode, "--strategies", " , ", "--out", "unused"]) == 2
    assert "--strategies is empty (' , '): name at least one" in capsys.readouterr().err


def test_profiles_parse_as_the_plan_names_them():
    from distft.bench.predict import parse_profile
    from distft.errors import ConfigError

    assert parse_profile("2xrtx4090-pcie") == parse_profile("2xrtx4090-pcie")
    p = parse_profile("8xh100-nvlink")
    assert (p.gpus, p.gpu, p.interconnect) == (8, "h100", "nvlink")
    p = parse_profile("2xa100-80gb")  # a GPU name with a hyphen, default link
    assert (p.gpus, p.gpu, p.interconnect) == (2, "a100-80gb", None)
    for bad in ("rtx4090", "2xwarp-drive", "0xh100"):
        with pytest.raises(ConfigError):
            parse_profile(bad)


def test_claims_read_the_projection():
    from distft.bench.predict import Profile, claims

    rows = {
        "single": {"tokens_per_s": 100.0, "speedup_vs_single": 1.0},
        "ddp": {"tokens_per_s": 190.0, "speedup_vs_single": 1.9},
        "fsdp": {"tokens_per_s": 120.0, "speedup_vs_single": 1.2},
        "tp-sp": {"tokens_per_s": 150.0, "speedup_vs_single": 1.5},
    }
    verdicts = {
        c["claim"]: c["supported"]
        for c in claims(rows, Profile("2xrtx4090-pcie", 2, "rtx4090", "pcie"), "pcie4")
    }
    assert verdicts == {"TP+SP beats FSDP on PCIe": True, "DDP near 2x on 2 GPUs": True}
    rows["ddp"]["speedup_vs_single"] = 1.3
    verdicts = {
        c["claim"]: c["supported"] for c in claims(rows, Profile("2xh100", 2, "h100", None), "nvlink4")
    }
    assert verdicts == {"DDP near 2x on 2 GPUs": False}  # not PCIe: the TP+SP claim does not apply


def test_ideal_timeline_replays_the_schedule_with_equal_stages():
    from distft.bench.plots import ideal_timeline

    timeline = timeline_1f1b(p=2, m=4)
    rows = ideal_timeline(timeline)
    assert [len(r) for r in rows] == [len(r["events"]) for r in timeline["ranks"]]  # every pass placed
    end = max(e["end"] for row in rows for e in row)
    idle = sum(1 - sum(e["end"] - e["start"] for e in row) / end for row in rows) / len(rows)
    assert idle == pytest.approx(timeline["idle_fraction_theory"])  # (p-1)/(m+p-1) = 1/5
    for row in rows:  # a rank runs one pass at a time
        assert all(a["end"] <= b["start"] for a, b in itertools.pairwise(row))


def test_pipeline_plots_from_a_fabricated_sweep(bench, tmp_path):
    from distft.bench.report import write_report

    _, results = bench
    sweep = []
    for schedule in ("gpipe", "1f1b"):
        for m in (2, 4):
            timeline = {**timeline_1f1b(2, m), "schedule": schedule}
            sweep.append({"schedule": schedule, "microbatches": m, "step_time_s": {"median": 0.2, "min": 0.2, "max": 0.2},
                          "losses": [1.0], "idle_fraction": 0.4, "idle_fraction_theory": 1 / (m + 1),
                          "idle_fraction_replayed": 0.35, "idle_fraction_imbalance_floor": 0.1,
                          "timeline": timeline})  # fmt: skip
    pp = {
        **results["results"][1],
        "strategy": "pp",
        "extra": {"idle_fraction": 0.5, "idle_fraction_theory": 0.2},
    }
    summary = {**results, "results": [*results["results"], pp], "pp_sweep": sweep}
    report = write_report(summary, tmp_path).read_text()
    assert "pp: each rank idles 50% of the step" in report
    for name in ("pp_idle.png", "pp_gantt_gpipe.png", "pp_gantt_1f1b.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    # Results from before the sweep had splits: the cut, the model and the verdicts unknown, said "-".
    assert "| 1f1b | 4 | - | - | 0.200 [0.200-0.200] | 40% | - | 20% | 10% | 35% | - | - | - | - |" in report
    assert "![1f1b timeline](pp_gantt_1f1b.png)" in report


def test_report_only_recomputes_projections_without_running(bench, tmp_path):
    import shutil

    out, _ = bench
    copy = tmp_path / "copy"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("runs"))
    args = ["bench", "--report-only", "--project", "2xh100-nvlink,8xh100-nvlink", "--out", str(copy)]
    assert main(args) == 0
    results = json.loads((copy / "results.json").read_text())
    assert [p["profile"] for p in results["projections"]] == ["2xh100-nvlink", "8xh100-nvlink"]
    eight = results["projections"][1]["strategies"]["ddp"]
    assert "cannot feed 8 replicas" in eight["note"]  # a global batch of 4: said, not projected
    assert "### projected: 8xh100-nvlink" in (copy / "report.md").read_text()


def test_all_to_all_bytes_match_summed_over_the_ranks():
    """fsdp+ep's all-to-alls are planned as the ranks' mean (a rank sends the rows its experts took,
    the routing's choice): the report matches them summed over the ranks, and says when that is off."""
    ranks = [
        {"comm_bytes_per_step": {"counted": {"all_to_all": sent}, "predicted": {"all_to_all": 100}}}
        for sent in (120, 80)
    ]
    summary = {"results": [{"strategy": "fsdp+ep", "comm_bytes": {"all_to_all": 120},
                            "comm_bytes_expected": {"all_to_all": 100}, "ranks": ranks}]}  # fmt: skip
    row = next(line for line in comm_section(summary) if line.startswith("| fsdp+ep"))
    assert row.endswith("| yes, summed over the ranks (a rank's share is the routing's) |")
    ranks[1]["comm_bytes_per_step"]["counted"]["all_to_all"] = 81
    assert routed_match(ranks).startswith("off by +1 B, summed over the ranks")
