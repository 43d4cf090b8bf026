"""Calibrating the pipeline's cut from a run's measured stage times
(`distft.parallel.pipeline.calibrate`): pure functions on hand-made timelines, no processes. The fit
recovers the costs a timeline was built from, for 2, 3 and 4 stages; it is the least-squares
solution, kept nonnegative; the cut it gives is `balanced_cut` of those costs; a file that cannot be
fitted is refused with the reason named."""

from __future__ import annotations

import json

import pytest
import torch

from distft.config import load_config
from distft.errors import ConfigError, DamagedFileError
from distft.model import model_config
from distft.parallel.pipeline.calibrate import (
    TIMELINE,
    calibrate,
    fit_costs,
    fit_timeline,
    read_timeline,
)
from distft.parallel.pipeline.cost import CostModel, balanced_cut, even_cut, stage_costs

# Binary fractions (seconds): every sum and quotient below is exact, so recovery is compared with ==.
LAYER, FIRST, LAST = 0.03125, 0.0625, 0.125


def timeline(cut, layer=LAYER, first=FIRST, last=LAST, schedule="1f1b") -> dict:
    """What a run of `cut` writes when each layer takes `layer` s a step and the ends add `first`, `last`."""
    return {
        "schedule": schedule,
        "ranks": [],
        "layers_per_stage": list(cut),
        "stage_busy_s": stage_costs(cut, [layer] * sum(cut), first, last),
    }


def test_two_stages_recover_the_layer_and_the_head():
    # Two equations, three unknowns: the embedding is taken as free (it is a lookup).
    costs = fit_timeline(timeline([3, 1], first=0.0))
    assert (costs.layer_s, costs.first_s, costs.last_s, costs.num_layers) == (LAYER, 0.0, LAST, 4)
    assert not costs.first_fitted
    # An embedding that does cost something is counted in stage 0's layers.
    costs = fit_timeline(timeline([2, 2]))
    assert (costs.layer_s, costs.first_s, costs.last_s) == (LAYER + FIRST / 2, 0.0, LAST - FIRST)


@pytest.mark.parametrize("cut", [[1, 2, 1], [3, 2, 2, 1], [1, 1, 1, 1], [2, 1, 3, 1, 1]])
def test_three_or_more_stages_recover_every_cost(cut):
    costs = fit_timeline(timeline(cut))
    assert (costs.layer_s, costs.first_s, costs.last_s, costs.num_layers) == (LAYER, FIRST, LAST, sum(cut))
    assert costs.first_fitted


def test_the_fit_is_least_squares():
    """Noisy stage times: the closed form equals torch's least-squares solve of the full system."""
    cut, busy = [2, 3, 2, 3, 1], [0.31, 0.42, 0.27, 0.45, 0.5]
    costs = fit_costs(cut, busy)
    rows = torch.tensor([[n, s == 0, s == len(cut) - 1] for s, n in enumerate(cut)], dtype=torch.float64)
    solved = torch.linalg.lstsq(rows, torch.tensor(busy, dtype=torch.float64)[:, None]).solution.flatten()
    assert [costs.layer_s, costs.first_s, costs.last_s] == pytest.approx(solved.tolist(), rel=1e-12)


def test_a_cost_below_zero_is_fixed_at_zero_and_the_layer_refitted():
    costs = fit_costs([1, 1, 1, 1], [0.9, 1.0, 1.0, 3.0])  # unconstrained: embedding -0.1
    assert costs.first_s == 0.0
    assert costs.layer_s == pytest.approx(2.9 / 3)  # stage 0 joins the middle stages' fit
    assert costs.last_s == pytest.approx(3.0 - 2.9 / 3)
    costs = fit_costs([2, 2], [1.0, 0.8])  # unconstrained: head -0.2; then both stages fit the layer
    assert (costs.first_s, costs.last_s) == (0.0, 0.0)
    assert costs.layer_s == pytest.approx((2 * 1.0 + 2 * 0.8) / 8)


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
def test_the_cut_is_the_balanced_cut_of_the_measured_costs(stages):
    costs = fit_timeline(timeline([2, 3, 2, 1]))  # 8 layers, measured as 4 stages
    assert costs.balanced_cut(stages) == balanced_cut([LAYER] * 8, stages, FIRST, LAST)
    # A head worth 4 layers on 2 stages: 6 layers, then 2 and the head.
    assert fit_timeline(timeline([4, 4], first=0.0)).balanced_cut(2) == (6, 2)


# ---- reading and refusing -------------------------------------------------------------------------


def test_timelines_that_cannot_be_fitted_are_refused():
    with pytest.raises(ConfigError, match="is not a pipeline timeline"):
        fit_timeline({"step": 3, "loss": 1.0}, "RUN/pipeline_timeline.json")
    older = {k: v for k, v in timeline([3, 1]).items() if k != "stage_busy_s"}
    with pytest.raises(ConfigError, match="no stage_busy_s: it comes from a distft from before"):
        fit_timeline(older)
    idle = {**timeline([3, 1]), "stage_busy_s": [0.4, 0.0]}
    with pytest.raises(ConfigError, match="stage 1 recorded no passes"):
        fit_timeline(idle)
    with pytest.raises(DamagedFileError, match="one time per stage"):
        fit_timeline({**timeline([3, 1]), "stage_busy_s": [0.4]})


def test_reading_names_the_file_and_how_to_get_one(tmp_path):
    with pytest.raises(ConfigError, match="no such run directory"):
        read_timeline(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=f"no {TIMELINE} there. Every pipeline run"):
        read_timeline(tmp_path)
    (tmp_path / TIMELINE).write_text("{cut short", encoding="utf-8")
    with pytest.raises(DamagedFileError, match="cannot be read as JSON"):
        read_timeline(tmp_path)


# ---- calibrating a config -------------------------------------------------------------------------


def _run(tmp_path, tl: dict) -> str:
    (tmp_path / TIMELINE).write_text(json.dumps(tl), encoding="utf-8")
    return str(tmp_path)


def _pp(*overrides: str):
    """A pp config of `tiny` (4 layers), whose head over Qwen3's whole vocabulary the FLOPs model
    makes outweigh every layer together (micro's 4,096-row head costs less than one)."""
    return load_config(None, ["model.name=tiny", "parallel.strategy=pp", "parallel.nproc=2", *overrides])


def test_calibrate_cuts_the_new_pipeline_and_records_where_from(tmp_path):
    # tiny (4 layers) measured at 2 stages, its head a little over one layer: the FLOPs model,
    # which makes the head outweigh every layer together, would leave the last stage one layer.
    run = _run(tmp_path, timeline([3, 1], layer=0.25, first=0.0, last=0.375))
    cfg = _pp()
    calibration = calibrate(cfg, run)
    assert calibration.cut == (3, 1)  # max(0.75, 0.625) beats max(0.5, 0.875)
    assert calibration.line() == (
        f"calibrated from {run} (1f1b, cut [3, 1]): 250.0 ms per layer, last stage +375.0 ms, first +0.0 ms "
        "(2 stages: in stage 0's layers) -> parallel.pp_split=[3, 1] (measured-cost imbalance 1.09; the "
        "FLOPs model's balanced cut [3, 1], even [2, 2])"
    )
    calibration.apply(cfg)
    assert cfg.parallel.pp_split == [3, 1]
    assert cfg.calibration["run"] == run and cfg.calibration["layer_s"] == 0.25
    # Another stage count: the new run's, interleaved over the same 2 ranks (4 stages of 1).
    four = calibrate(_pp("parallel.schedule=interleaved-1f1b", "parallel.microbatches=2"), run)
    assert four.cut == four.even == (1, 1, 1, 1)


def test_calibrate_refuses_what_it_cannot_cut(tmp_path):
    run = _run(tmp_path, timeline([3, 1]))
    with pytest.raises(ConfigError, match="--strategy ddp has none: use --strategy pp"):
        calibrate(load_config(None, ["model.name=micro", "parallel.strategy=ddp"]), run)
    with pytest.raises(ConfigError, match=r"and parallel.pp_split=\[2,2\] both set parallel.pp_split"):
        calibrate(_pp("parallel.pp_split=[2,2]"), run, ["parallel.pp_split=[2,2]"])
    six = _run(tmp_path, timeline([3, 3]))
    with pytest.raises(ConfigError, match="that run's model has 6 decoder layers, tiny has 4"):
        calibrate(_pp(), six)


def test_the_flops_model_disagrees_where_the_head_is_cheap(tmp_path):
    """The case calibration exists for: measured, tiny's head costs less than a layer."""
    cfg = _pp()
    assert CostModel.for_run(cfg, model_config("tiny")).balanced_cut(2) == (3, 1)
    calibration = calibrate(cfg, _run(tmp_path, timeline([3, 1], layer=0.25, first=0.0, last=0.125)))
    assert calibration.cut == even_cut(4, 2) == (2, 2)
