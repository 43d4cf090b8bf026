"""Pipeline parallelism (`pp`) trains, exports and checkpoints exactly what one process does.

Every schedule runs once through the CLI on 2 gloo ranks (one torchrun launch each) and the
tests below read what those runs wrote: per-step losses, gradient norms and the adapter against
the single-process run on the same global batch; bytes sent between stages on the first step
against the analytic count; the timeline file. No timing value is asserted (2 shared cores).
"""

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from distft.cli import main
from distft.config import load_config
from distft.measure.pipeline import replay
from distft.model.presets import MICRO_VOCAB
from distft.parallel.pipeline import Layout, layout
from distft.parallel.pipeline.stages import schedule_actions
from tests.helpers import PARITY, adapter, assert_same_training, crashed_copy, distft, metrics

WORLD = 2
SCHEDULES = {  # schedule -> extra arguments of its run
    "gpipe": ["parallel.microbatches=2"],  # 2 micro-batches of 2 sequences instead of 4 of 1
    "1f1b": [],
    "interleaved-1f1b": ["--checkpoint-every", "2"],  # V=2: stages 0,2 on rank 0 and 1,3 on rank 1
    "zero-bubble": [],
    "zbv": [],  # V-shaped: stages 0,3 on rank 0 and 1,2 on rank 1
}
# micro: hidden 32; PARITY: sequences padded to 384, global batch 4 (fp32 activations).
ACTIVATIONS_PER_STEP = 4 * 384 * 32 * 4  # one direction, one stage boundary, all micro-batches
# Boundaries that cross from or to rank 0 (each carries activations one way, gradients back).
HOPS = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 3, "zero-bubble": 1, "zbv": 2}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    assert main(["train", *PARITY, "--out", str(out)]) == 0  # in-process: one interpreter start fewer
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    for schedule, extra in SCHEDULES.items():
        out = root / schedule
        args = ["--strategy", "pp", "--nproc", str(WORLD), *PARITY, f"parallel.schedule={schedule}", *extra]
        distft("train", *args, "--out", str(out))
    return {schedule: root / schedule for schedule in SCHEDULES}


def test_every_schedule_trains_like_one_process(runs, reference):
    for schedule, out in runs.items():
        try:
            assert_same_training(out, reference)
        except AssertionError as err:
            raise AssertionError(f"{schedule}: {err}") from err
        assert metrics(out)[-1]["eval_loss"] == pytest.approx(metrics(reference)[-1]["eval_loss"], rel=1e-5)


def test_bytes_between_stages_match_the_analytic_count(runs):
    for schedule, out in runs.items():
        first = metrics(out)[0]  # rank 0's counter, first step
        assert first["comm_bytes"] == first["comm_bytes_expected"], schedule
        # Independently of the strategy's formula: one hidden-state tensor per micro-batch per
        # boundary forward, one gradient back; the loss (fp32) and the squared norm (fp64) after.
        m = 2 if schedule == "gpipe" else 4
        hops = HOPS[schedule]
        assert first["comm_bytes"] == {
            "send": hops * ACTIVATIONS_PER_STEP,
            "recv": hops * ACTIVATIONS_PER_STEP,
            "all_reduce": 4 + 8,
        }, schedule
        assert first["comm_calls"] == {"send": hops * m, "recv": hops * m, "all_reduce": 2}, schedule


def test_timeline_is_written_and_well_formed(runs):
    for schedule, out in runs.items():
        timeline = json.loads((out / "pipeline_timeline.json").read_text())
        cfg = load_config(out / "config.toml")
        lay = layout(cfg)
        assert (timeline["schedule"], timeline["p"], timeline["m"], timeline["V"]) == (
            schedule,
            WORLD,
            lay.microbatches,
            lay.stages_per_rank,
        )
        assert timeline["step"] == cfg.train.max_steps
        assert timeline["idle_fraction_theory"] == pytest.approx(lay.theoretical_idle_fraction())
        assert 0 <= timeline["idle_fraction"] < 1
        # The modelled figures of the cut the run used (balanced: micro's head over 4,096 tokens
        # costs less than a layer on these rows, so 2 stages split the layers evenly), beside the
        # measured stage imbalance.
        assert timeline["layers_per_stage"] == ([2, 2] if lay.num_stages == 2 else [1, 1, 1, 1])
        assert timeline["modelled"]["cut"]["layers_per_stage"] == timeline["layers_per_stage"]
        assert 0 <= timeline["idle_fraction_modelled"] < 1
        assert timeline["stage_imbalance"] >= 1 and timeline["stage_imbalance_modelled"] >= 1
        assert len(timeline["stage_busy_s"]) == lay.num_stages
        # The replay follows the schedule's own action order: it completes for every schedule.
        assert 0 <= timeline["idle_fraction_replayed"] < 1
        assert 0 <= timeline["idle_fraction_imbalance_floor"] < 1
        kinds = "FBW" if schedule in ("zero-bubble", "zbv") else "FB"
        assert [r["rank"] for r in timeline["ranks"]] == list(range(WORLD))
        for r in timeline["ranks"]:
            assert r["stages"] == lay.stages_of(r["rank"])
            assert 0 <= r["idle_fraction"] < 1
            assert r["busy_s"] == pytest.approx(sum(e["end"] - e["start"] for e in r["events"]))
            for e in r["events"]:
                assert 0 <= e["start"] <= e["end"] <= r["step_time_s"], (schedule, e)
            # Every stage of this rank computed each of its passes once per micro-batch.
            done = sorted((e["stage"], e["kind"], e["microbatch"]) for e in r["events"])
            assert done == sorted(
                (s, k, i) for s in r["stages"] for k in kinds for i in range(lay.microbatches)
            ), schedule
        for record in metrics(out):
            assert 0 <= record["idle_fraction"] < 1
            assert record["idle_fraction_theory"] == timeline["idle_fraction_theory"]
            assert record["idle_fraction_modelled"] == timeline["idle_fraction_modelled"]


def test_calibrating_from_a_run_cuts_the_next_one(runs, tmp_path, capsys):
    """`--calibrate RUN --dry-run` (nothing launched): the zbv run's 4 measured stages fitted,
    which separates the embedding, the layers and the head, and a 2-stage 1f1b run cut by them."""
    run = runs["zbv"]
    args = [*PARITY, "--strategy", "pp", "--nproc", str(WORLD), "--calibrate", str(run), "--dry-run"]
    assert main(["train", *args, "--out", str(tmp_path / "next")]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("calibrated from")]
    assert line.startswith(f"calibrated from {run} (zbv, cut [1, 1, 1, 1]): ")
    assert " ms per layer, last stage +" in line and "(2 stages" not in line
    assert "-> parallel.pp_split=[" in line and line.endswith("even [2, 2])")


def _logits(base_dir, adapter_dir) -> torch.Tensor:
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
    ids = torch.randint(0, 4000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_adapter_loads_in_one_process(runs, reference, capsys):
    """Stages hold adapters under global layer indices: the export is an ordinary PEFT adapter."""
    want = _logits(reference / "base", reference / "adapter")
    for schedule in ("interleaved-1f1b", "zbv"):  # looped and V-shaped placements
        out = runs[schedule]
        layers = {name.split("layers.")[1].split(".")[0] for name in adapter(out)}
        assert layers == {"0", "1", "2", "3"}, schedule
        got = _logits(out / "base", out / "adapter")
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # What users run: `distft infer` loads the run's adapter in one process and generates.
    assert main(["infer", "--run", str(runs["zbv"]), "--max-new-tokens", "2"]) == 0
    assert "generated summary" in capsys.readouterr().out


def test_resumes_from_a_checkpoint(runs, reference, tmp_path):
    """Stage parameters are checkpointed under their global names; a resumed run ends the same."""
    out = crashed_copy(runs["interleaved-1f1b"], tmp_path / "resumed", 2)  # the run never exported
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002"]
    proc = distft("train", "--resume", str(out))
    assert "resuming from" in proc.stdout
    assert_same_training(out, reference)


def test_full_finetune_sums_the_tied_embedding(tmp_path):
    """micro ties embedding and lm_head: stage 0 (rank 0) and the last stage (rank 1) each hold a
    copy and see half of its uses; their gradients are summed so both copies stay equal."""
    full = [*PARITY, "--method", "full", "train.max_steps=2"]
    assert main(["train", *full, "--out", str(tmp_path / "single")]) == 0
    distft("train", "--strategy", "pp", "--nproc", str(WORLD), *full, "--out", str(tmp_path / "pp"))
    got, want = metrics(tmp_path / "pp"), metrics(tmp_path / "single")
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5)
    embedding = MICRO_VOCAB * 32 * 4
    assert (
        got[0]["comm_bytes"]["all_reduce"] == embedding + 4 + 8 == got[0]["comm_bytes_expected"]["all_reduce"]
    )
    from safetensors.torch import load_file

    a = load_file(tmp_path / "pp" / "model" / "model.safetensors")
    b = load_file(tmp_path / "single" / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in b:
        assert (a[name] - b[name]).norm() <= 1e-5 * b[name].norm(), name


# PARITY over 2 steps of shorter rows, no base weights written (the adapters compare as tensors).
SPLIT_RUN = [
    *(a for a in PARITY if a not in ("train.max_steps=3", "data.max_length=384")),
    "train.max_steps=2",
    "data.max_length=256",
    "output.save_base=false",
]


def test_an_uneven_split_trains_like_one_process_and_resumes_under_another(tmp_path):
    """parallel.pp_split=[1,3] (stage 0: the embedding and layer 0; stage 1: layers 1-3 and the
    head) trains exactly like one process. Its step-1 checkpoint then resumes under the balanced
    cut, [3,1]: DCP keys are the single model's parameter names, so each rank loads the layers
    its new stage holds, wherever they were saved from, and step 2 ends as one process ends it."""
    reference, run, resumed = tmp_path / "single", tmp_path / "pp", tmp_path / "resumed"
    assert main(["train", *SPLIT_RUN, "--out", str(reference)]) == 0
    pp = ["--strategy", "pp", "--nproc", str(WORLD)]
    split = ["parallel.pp_split=[1,3]", "--checkpoint-every", "1"]
    proc = distft("train", *pp, *SPLIT_RUN, *split, "--out", str(run))
    assert "pipeline cut (parallel.pp_split=[1, 3]): layers 1/3" in proc.stdout
    assert_same_training(run, reference)
    ranks = json.loads((run / "ranks.json").read_text())
    assert [r["pipeline"]["stages"] for r in ranks] == [{"0": [0]}, {"1": [1, 2, 3]}]
    assert ranks[0]["pipeline"]["even"]["layers_per_stage"] == [2, 2]

    # The run as a crash during step 2 leaves it: step 1's checkpoint, no adapter.
    crashed_copy(run, resumed, 1)
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["step-000001"]
    proc = distft("train", "--resume", str(resumed), "parallel.pp_split=balanced")
    assert "resuming from" in proc.stdout and "(step 1)" in proc.stdout
    assert "pipeline cut (parallel.pp_split=balanced): layers 3/1" in proc.stdout
    assert_same_training(resumed, reference)
    record = metrics(resumed)[-1]
    assert record["stage_imbalance_modelled"] < 2  # the head's stage, over the mean of two
    assert 0 <= record["idle_fraction_modelled"] < 1 and record["stage_imbalance"] >= 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.microbatches=1"], "at least as many micro-batches as pipeline ranks"),
        (["parallel.microbatches=3"], "cannot be cut into 3 equal micro-batches"),
        (["--nproc", "3", "parallel.schedule=interleaved-1f1b"], "needs 6 stages"),
        (["parallel.schedule=gpipe", "parallel.stages_per_rank=2"], "runs one stage per rank"),
        (["parallel.schedule=zbv", "parallel.stages_per_rank=3"], "exactly 2 stages per rank"),
        (
            ["parallel.schedule=interleaved-1f1b", "train.global_batch_size=10", "parallel.microbatches=5"],
            "rounds",
        ),
        (["parallel.schedule=pipedream"], "choose one of"),
        (["--nproc", "1"], "--nproc 2 or more"),
        (["parallel.pp_split=[1,1,2]"], "gives 3 stages, but parallel.schedule=1f1b"),
        (["parallel.pp_split=[3,2]"], "places 5 decoder layers, but micro has 4"),
    ],
)
def test_impossible_pipelines_fail_before_launch(overrides, message, capsys):
    args = ["train", "--strategy", "pp", "--nproc", "2", "--model", "micro", *overrides]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_layout():
    def lay(schedule, nproc=2, **parallel):
        extra = [f"parallel.{k}={v}" for k, v in parallel.items()]
        return layout(
            load_config(
                None,
                ["parallel.strategy=pp", f"parallel.nproc={nproc}", f"parallel.schedule={schedule}", *extra],
            )
        )

    looped, v_shaped = lay("interleaved-1f1b"), lay("zbv")
    assert [looped.stages_of(r) for r in range(2)] == [[0, 2], [1, 3]]
    assert [v_shaped.stages_of(r) for r in range(2)] == [[0, 3], [1, 2]]
    # The cut (parallel.pp_split) needs the architecture: tests/parallel/test_pipeline_cost.py.
    assert lay("gpipe", nproc=3).layers_per_stage == ()
    # tiny's default global batch 8 / micro-batch 4: m = 2; microbatches=4 makes the micro-batch 2.
    assert (lay("1f1b").microbatches, lay("1f1b", microbatches=4).micro_batch_size) == (2, 2)
    assert lay("gpipe", microbatches=4).theoretical_idle_fraction() == pytest.approx(1 / 5)
    assert lay("interleaved-1f1b", microbatches=4).theoretical_idle_fraction() == pytest.approx(1 / 9)
    assert lay("zbv", microbatches=4).theoretical_idle_fraction() == pytest.approx(1 / 25)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8)])
def test_replay_of_equal_stages_is_the_theoretical_bubble(schedule, p, m):
    """The timeline's replay (torch's order, measured pass times, free messages) with equal stages
    (F = 1, full B = 2) idles exactly the bubble the layout predicts."""
    lay = Layout(schedule, ranks=p, stages_per_rank=1, microbatches=m, micro_batch_size=1)
    durations = {(s, kind): {"F": 1.0, "B": 2.0}[kind] for s in range(p) for kind in "FB"}
    replayed = replay(schedule_actions(lay, schedule=None), durations)
    assert replayed == pytest.approx(lay.theoretical_idle_fraction())
