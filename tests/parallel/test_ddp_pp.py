"""2D parallelism (`ddp+pp`, dp=2 x pp=2 on 4 gloo processes) trains exactly like one process.

One 4-process run (micro, 2 steps, sequences of 256: ~45 s on 2 shared cores) checks the losses,
gradient norms and exported adapter against the single-process reference on the same global
batch, and the bytes of the first step against the analytic count and an independent one. The
mesh's validation runs in process, before any launch.
"""

import json

import pytest
from safetensors.torch import load_file

from distft.cli import main
from distft.config import load_config
from distft.layout import ParallelDims
from distft.parallel import STRATEGIES
from tests.helpers import PARITY, assert_same_training, distft, metrics

TWO_D = [*PARITY, "train.max_steps=2", "data.max_length=256", "data.max_rows=16"]


def test_matches_single_process(tmp_path):
    reference, out = tmp_path / "single", tmp_path / "ddp+pp"
    assert main(["train", *TWO_D, "--out", str(reference)]) == 0  # in-process: one interpreter start fewer
    proc = distft(
        "train", "--strategy", "ddp+pp", "--nproc", "4", "parallel.dp=2", "parallel.pp=2", *TWO_D,
        "--out", str(out), timeout=400,
    )  # fmt: skip
    # The global batch splits over the 2 pipeline replicas, not the 4 ranks.
    assert "global batch 4 = micro-batch 1 x accumulation 2 x data-parallel ranks 2" in proc.stdout
    assert_same_training(out, reference)
    assert metrics(out)[-1]["eval_loss"] == pytest.approx(metrics(reference)[-1]["eval_loss"], rel=1e-5)

    # Rank 0 = pipeline rank 0 of replica 0: stage 0, layers 0-2 of micro's 4 (the balanced cut:
    # lm_head on the labelled positions outweighs micro's layers, so the last stage keeps one).
    first = metrics(out)[0]
    assert first["comm_bytes"] == first["comm_bytes_expected"]
    ranks = json.loads((out / "ranks.json").read_text())
    assert [r["pipeline"]["cut"]["layers_per_stage"] for r in ranks] == [[3, 1]] * 4  # every replica
    assert ranks[0]["pipeline"]["stages"] == {"0": [0, 1, 2]}
    exported = load_file(out / "adapter" / "adapter_model.safetensors")
    assert {name.split("layers.")[1].split(".")[0] for name in exported} == {"0", "1", "2", "3"}
    stage_grads = sum(
        t.numel() * t.element_size()
        for n, t in exported.items()
        if any(f".layers.{i}." in n for i in (0, 1, 2))
    )
    activations = 2 * 256 * 32 * 4  # 2 micro-batches of (1, 256, hidden 32), fp32, one boundary
    assert first["comm_bytes"] == {
        "send": activations,  # hidden states to stage 1 (pp)
        "recv": activations,  # their gradients back (pp)
        "all_reduce": 4 + 8 + stage_grads,  # loss (world), norm (pp), stage 0's gradients (dp)
    }
    assert first["comm_calls"] == {"send": 2, "recv": 2, "all_reduce": 3}
    timeline = json.loads((out / "pipeline_timeline.json").read_text())
    assert (timeline["p"], timeline["m"]) == (2, 2)
    assert [(r["rank"], r["stages"]) for r in timeline["ranks"]] == [(0, [0]), (1, [0]), (2, [1]), (3, [1])]


def test_mesh_layout():
    dims = ParallelDims(dp_replicate=2, pp=2)
    # pp outermost: pipelines {0, 2} and {1, 3}; data-parallel groups {0, 1} and {2, 3}.
    assert [(c["pp"], c["dp"]) for c in map(dims.coordinates, range(4))] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    overrides = ["parallel.strategy=ddp+pp", "parallel.nproc=8", "parallel.pp=2", "train.micro_batch_size=1"]
    cfg = load_config(None, overrides)
    assert STRATEGIES["ddp+pp"].data_parallel_size(cfg) == 4  # dp=0: what pp leaves
    # tiny's global batch 8 over 4 replicas: 2 sequences per pipeline, in micro-batches of 1.
    lay = STRATEGIES["ddp+pp"].pipeline_layout(cfg)
    assert (lay.ranks, lay.microbatches, lay.micro_batch_size) == (2, 2, 1)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["parallel.dp=3", "parallel.pp=2"], "3 x 1 x 2 = 6, but the run has 4 processes"),
        (["parallel.pp=3"], "does not divide the 4 processes"),
        (["parallel.pp=1"], "use --strategy ddp"),
        (["parallel.dp=1", "parallel.pp=4"], "use --strategy pp"),
        (["parallel.tp=2", "parallel.pp=2"], "parallel.tp must be 1"),
        (
            ["parallel.pp=2", "train.global_batch_size=8", "parallel.microbatches=3"],
            "share of train.global_batch_size (8 / 2 = 4) cannot be cut into 3",
        ),
        (["parallel.pp=2", "--method", "qlora"], "--method qlora cannot run with --strategy ddp+pp"),
    ],
)
def test_refused_before_launch(args, expected, capsys, tmp_path):
    cmd = ["train", "--model", "micro", "--strategy", "ddp+pp", "--nproc", "4", *args]
    assert main([*cmd, "train.micro_batch_size=1", "--out", str(tmp_path)]) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "config.toml").exists()
