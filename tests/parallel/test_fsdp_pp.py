"""`fsdp+pp` and the 3D `fsdp+tp+pp` train exactly like one process, running the planner's own `run:` lines.

Each run is the command `distft plan` prints for that layout (parsed from its `run:` line, plus the
suite's step count, data size and learning rate) on gloo processes: losses, gradient norms and the
exported adapter against the single-process `reference`; every byte of the first step against the
runtime's formula (`measure.expected.fsdp_pipeline`), against the planner's bytes per mesh
dimension, and against counts made here from the saved weights: fsdp+pp at dp = 2 x pp = 2, a
resume from its DCP checkpoint, 3D at dp = 1 x tp = 2 x pp = 2 (a real 3D mesh whose dp dimension
has one rank: every code path runs, FSDP moves no bytes) and at dp = tp = pp = 2 on 8 processes,
and fsdp+pp with full finetuning (the tied embedding's shards summed across stages) and with QLoRA.
"""

import json
import shlex

import pytest
from safetensors.torch import load_file

from distft.cli import build_parser, main
from distft.model.presets import MICRO_VOCAB
from distft.plan import make_request, run_command
from distft.plan.estimate import Request, evaluate, parallelism_for
from distft.plan.inputs import Parallelism
from distft.plan.memory import state_bytes
from distft.plan.traffic import step_collectives
from tests.helpers import PARITY, adapter, assert_same_training, crashed_copy, distft, metrics

# What PARITY adds to a run: length of training and data, the optimizer (the layout comes from the plan).
STEPS_AND_DATA = {
    "train.max_steps",
    "train.eval_every",
    "train.eval_batches",
    "data.max_rows",
    "optim.warmup_steps",
    "optim.lr",
    "optim.eps",
}
SUITE = [a for a in PARITY if a.split("=")[0] in STEPS_AND_DATA]
# micro, fp32, sequences of 384, global batch 4 of 1-sequence micro-batches: PARITY's shape, with
# about as many labelled positions as the suite's summaries (the runtime cuts the pipeline by the
# data's measured mean; at micro's size the head's cost, and so the cut, depends on it).
PLAN = (
    "--model micro --method lora --gpu h100 --precision fp32 --seq-len 384 --micro-batch 1 --label-tokens 96"
)
HIDDEN, SEQ = 32, 384


def request(command: str):
    return make_request(build_parser().parse_args(["plan", *command.split()]))


def planned_line(gpus: int, strategy: str, **degrees: int) -> tuple[list[str], Request, Parallelism]:
    """The plan's `run:` line for `strategy` at these degrees (as argv), its request and layout."""
    dp = degrees.get("dp", 1)
    req = request(f"{PLAN} --gpus {gpus} --pp-microbatches {4 // dp}")
    lay = parallelism_for(req, strategy, **degrees)
    argv = shlex.split(run_command(req, strategy, "lora", "none", lay))
    assert argv[:2] == ["distft", "train"] and "train.global_batch_size=4" in argv
    return argv[1:], req, lay


def planned_bytes(req: Request, lay: Parallelism) -> dict[str, int]:
    """The planner's bytes per step on rank 0 (pipeline rank 0), by kind of collective."""
    planned: dict[str, int] = {}
    for c in step_collectives(req.model, req.training, lay, req.topology):
        planned[c.kind] = planned.get(c.kind, 0) + int(c.logical_bytes)
    return planned


# Stage 0 of 2 on micro: the embedding and layers 0-1 (the balanced cut: lm_head on ~100 labelled
# positions costs less than one of micro's layers, so the stages split them evenly; ranks.json
# records it).
STAGE_0 = ("0", "1")


def stage0_bytes(run_dir, reference, layers=STAGE_0) -> tuple[int, int]:
    """(weights, adapter) bytes of stage 0 of 2 on micro: the embedding and its layers, counted
    from the files the runs wrote (no padding: every dim 0 of micro is even)."""
    base = load_file(reference / "base" / "model.safetensors")
    held = [t for n, t in base.items() if "embed_tokens" in n or any(f"layers.{i}." in n for i in layers)]
    lora = [t for n, t in adapter(run_dir).items() if any(f"layers.{i}." in n for i in layers)]
    weights = sum(t.numel() * t.element_size() for t in held)
    return weights, sum(t.numel() * t.element_size() for t in lora)


@pytest.fixture(scope="module")
def fsdp_pp(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_pp") / "run"
    argv, req, lay = planned_line(4, "fsdp+pp", dp=2, pp=2)
    distft(*argv, *SUITE, "--checkpoint-every", "2", "--out", str(out), timeout=400)
    return out, req, lay


def test_fsdp_pp_trains_like_one_process(fsdp_pp, reference):
    out, req, lay = fsdp_pp
    assert_same_training(out, reference)
    # Evaluation runs the stages outside the schedule, gathering and resharding them itself.
    assert metrics(out)[-1]["eval_loss"] == pytest.approx(metrics(reference)[-1]["eval_loss"], rel=1e-5)
    first = metrics(out)[0]  # rank 0: pipeline rank 0 (stage 0) of replica 0
    assert first["comm_bytes"] == first["comm_bytes_expected"]
    weights, lora = stage0_bytes(out, reference)
    activations = 2 * SEQ * HIDDEN * 4  # 2 micro-batches of (1, 384, 32) fp32 per replica, one boundary
    assert first["comm_bytes"] == {
        "all_gather": weights + lora,  # dp: stage 0 gathered once for the step
        "reduce_scatter": lora,  # dp: its adapters' gradients, once, after the last backward
        "send": activations,  # pp: hidden states to stage 1
        "recv": activations,  # pp: their gradients back
        "all_reduce": 4 + 8,  # world: the loss and the gradient norm
    }
    # The planner's bytes, kind by kind, are the ones counted.
    assert planned_bytes(req, lay) == first["comm_bytes"]
    # And what each rank holds between steps, 1/dp of its stage, is the planner's to the byte.
    for r in json.loads((out / "ranks.json").read_text()):
        held = state_bytes(req.model, req.training, lay, dp_rank=r["rank"] % 2, stage=r["rank"] // 2)
        assert (held.params, held.grads, held.optimizer) == (
            r["param_bytes"]["dense"],
            r["grad_bytes"],
            r["optimizer_bytes"],
        )
    assert json.loads((out / "ranks.json").read_text())[0]["pipeline"]["stages"] == {"0": [0, 1]}
    # Units: layers 0-1 and the stage (its embedding); the embedding is frozen: no reduce-scatter.
    assert first["comm_calls"] == {
        "all_gather": 3,
        "reduce_scatter": 2,
        "send": 2,
        "recv": 2,
        "all_reduce": 2,
    }
    timeline = json.loads((out / "pipeline_timeline.json").read_text())
    assert [(r["rank"], r["stages"]) for r in timeline["ranks"]] == [(0, [0]), (1, [0]), (2, [1]), (3, [1])]


def test_fsdp_pp_resumes_from_a_checkpoint(fsdp_pp, reference, tmp_path):
    """Each stage's shards are saved by DCP under global names; a resumed run ends the same."""
    out = crashed_copy(fsdp_pp[0], tmp_path / "resumed", 2)  # the run never exported
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002"]
    proc = distft("train", "--resume", str(out), timeout=400)
    assert "resuming from" in proc.stdout
    assert_same_training(out, reference)


def test_3d_on_a_mesh_with_one_fsdp_rank(reference, tmp_path):
    """dp = 1 x tp = 2 x pp = 2: TP inside each stage, the pipeline across, FSDP over one rank."""
    argv, req, lay = planned_line(4, "fsdp+tp+pp", dp=1, tp=2, pp=2)
    out = tmp_path / "3d"
    distft(*argv, *SUITE, "--out", str(out), timeout=400)
    assert_same_training(out, reference)
    assert metrics(out)[-1]["eval_loss"] == pytest.approx(metrics(reference)[-1]["eval_loss"], rel=1e-5)
    first = metrics(out)[0]
    assert first["comm_bytes"] == first["comm_bytes_expected"]
    activations = 4 * SEQ * HIDDEN * 4  # 4 micro-batches through the one pipeline of this TP rank
    tp = first["comm_bytes"]["all_reduce"] - 4 - 8  # TP's all-reduces inside stage 0's layers
    assert first["comm_bytes"] == {"send": activations, "recv": activations, "all_reduce": tp + 12}
    assert planned_bytes(req, lay) == first["comm_bytes"]  # none over one FSDP rank
    # Per micro-batch, stage 0's n = 2 layers: 2 n forward + 5 n backward - 3 (layer 0's q, k, v
    # input is the frozen embedding's output) activation all-reduces, and one (1, 384, r=16) per
    # adapter: 2 row projections in forward, 5 column ones in backward.
    n = len(json.loads((out / "ranks.json").read_text())[0]["pipeline"]["stages"]["0"])
    assert n == len(STAGE_0)
    assert tp == 4 * 4 * SEQ * (HIDDEN * (2 * n + 5 * n - 3) + 16 * n * 7)


def test_3d_on_eight_processes(reference, tmp_path):
    """dp = tp = pp = 2, the layout the planner picks for 3D on 8 GPUs of one node."""
    req = request(f"{PLAN} --gpus 8 --pp-microbatches 2")
    lay = evaluate(req)["fsdp+tp+pp"].parallelism
    assert (lay.dp, lay.tp, lay.pp) == (2, 2, 2)
    argv = shlex.split(run_command(req, "fsdp+tp+pp", "lora", "none", lay))
    out = tmp_path / "3d8"
    distft(*argv[1:], *SUITE, "--out", str(out), timeout=400)
    assert_same_training(out, reference)
    first = metrics(out)[0]
    assert first["comm_bytes"] == first["comm_bytes_expected"]
    # dp: stage 0's TP slice gathered, its adapters' TP-local gradients scattered; tp: the
    # activations; pp: the sends and receives; the loss and the norm: the planner's, to the byte.
    assert planned_bytes(req, lay) == first["comm_bytes"]


@pytest.mark.parametrize("method", ["full", "qlora"])
def test_fsdp_pp_full_finetuning_and_qlora(method, tmp_path):
    """Full: micro ties embedding and lm_head, split over stage 0 and 1; each stage's FSDP shards
    of it are summed across the pipeline. QLoRA: the NF4 base shards and gathers as under fsdp."""
    run = [*PARITY, "--method", method, "output.save_base=false"]
    assert main(["train", *run, "--out", str(tmp_path / "single")]) == 0
    layout = ["--strategy", "fsdp+pp", "--nproc", "4", "parallel.dp=2", "parallel.pp=2"]
    distft("train", *run, *layout, "--out", str(tmp_path / "fsdp+pp"), timeout=400)
    got, want = metrics(tmp_path / "fsdp+pp"), metrics(tmp_path / "single")
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5)
    assert got[0]["comm_bytes"] == got[0]["comm_bytes_expected"]
    folder, file = (
        ("model", "model.safetensors") if method == "full" else ("adapter", "adapter_model.safetensors")
    )
    a, b = (load_file(tmp_path / run / folder / file) for run in ("fsdp+pp", "single"))
    assert a.keys() == b.keys()
    for name in b:
        assert (a[name] - b[name]).norm() <= 1e-5 * b[name].norm(), name
    if method == "full":  # the tie: this rank's half of the (4,096, 32) fp32 gradient, world scalars
        assert got[0]["comm_bytes"]["all_reduce"] == MICRO_VOCAB // 2 * 32 * 4 + 4 + 8


@pytest.mark.parametrize(
    ("strategy", "args", "expected"),
    [
        ("fsdp+pp", ["parallel.dp=3", "parallel.pp=2"], "3 x 1 x 2 = 6, but the run has 4 processes"),
        ("fsdp+pp", ["parallel.pp=1"], "use --strategy fsdp,"),
        ("fsdp+pp", ["parallel.dp=1", "parallel.pp=4"], "use --strategy pp"),
        ("fsdp+pp", ["parallel.tp=2", "parallel.pp=2"], "use --strategy fsdp+tp+pp"),
        ("fsdp+pp", ["parallel.pp=2", "parallel.fsdp_prefetch=-1"], "cannot be negative"),
        # zbv puts the first and last stage on rank 0: two FSDP units would split the tied weight.
        ("fsdp+pp", ["parallel.pp=2", "parallel.schedule=zbv", "--method", "full"], "train apart"),
        ("fsdp+tp+pp", ["parallel.tp=1", "parallel.pp=2"], "needs parallel.tp of 2 or more"),
        ("fsdp+tp+pp", ["parallel.tp=2", "parallel.pp=1"], "use --strategy fsdp+tp,"),
        (
            "fsdp+tp+pp",
            ["parallel.tp=2", "parallel.pp=2", "--method", "qlora"],
            "cannot run with --strategy fsdp+tp+pp",
        ),
        # micro has 4 query heads and 2 KV heads: 4 TP ranks cannot split them.
        ("fsdp+tp+pp", ["--nproc", "8", "parallel.tp=4", "parallel.pp=2"], "4 query heads and 2 KV heads"),
        # micro has 4 layers: 8 stages (4 pipeline ranks x 2 interleaved) cannot each take one.
        ("fsdp+tp+pp", ["--nproc", "16", "parallel.tp=2", "parallel.pp=8"], "needs 8 stages"),
    ],
)
def test_refused_before_launch(strategy, args, expected, capsys, tmp_path):
    cmd = ["train", "--model", "micro", "--strategy", strategy, "--nproc", "4", *args]
    assert main([*cmd, "train.micro_batch_size=1", "--out", str(tmp_path)]) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "config.toml").exists()
