"""HSDP on 4 gloo processes (2 shard groups of 2) trains exactly like one process, and moves the
bytes it should on each mesh dimension.

One launch: `distft train --strategy hsdp --nproc 4 parallel.shard=2` with a global batch of 8, so
each rank accumulates 2 micro-batches and the replicas' all-reduce runs once per step, not per
micro-batch (`set_requires_all_reduce`). Its losses, gradient norms and adapter equal a single
process's on the same global batches; its first step's bytes, counted per process group
(`CommStats.by_dim`), equal the analytic bytes per dimension, written out here from the model:
- shard ({0, 1} and {2, 3}): every parameter all-gathered twice per micro-batch, the trainable
  gradients reduce-scattered once per micro-batch, each padded to a multiple of 2 rows;
- replicate ({0, 2} and {1, 3}): each rank's gradient shard all-reduced once;
- world: the loss (fp32) and the gradient norm's sum of squares (float64).
Then its checkpoint of step 1 (2D DTensors) resumes in one process and ends like the reference.
HSDP x TP (`hsdp+tp`, 8 ranks) runs against the same reference, its bytes per dimension as
planned, and resumes as plain HSDP.
"""

import json

import pytest
import torch

from distft.cli import main
from distft.config import load_config
from distft.model import apply_method, load_base_model
from tests.helpers import PARITY, assert_same_training, crashed_copy, distft, metrics

WORLD, SHARD, ACCUMULATION = 4, 2, 2
GLOBAL_BATCH = ["train.global_batch_size=8", "train.max_steps=2"]  # 8 = micro 1 x 2 x 4 ranks


def padded_bytes(p: torch.Tensor, n: int) -> int:
    return -(-p.shape[0] // n) * n * (p.numel() // p.shape[0]) * p.element_size()


def expected_by_dim() -> dict[str, dict[str, int]]:
    cfg = load_config(None, ["model.name=micro"])
    torch.manual_seed(0)
    model = apply_method(load_base_model(cfg.model), cfg)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    return {
        "shard": {
            "all_gather": ACCUMULATION * 2 * sum(padded_bytes(p, SHARD) for p in params),
            "reduce_scatter": ACCUMULATION * sum(padded_bytes(p, SHARD) for p in trainable),
        },
        "replicate": {"all_reduce": sum(padded_bytes(p, SHARD) // SHARD for p in trainable)},
        "world": {"all_reduce": 4 + 8},
    }


def test_matches_single_process_with_bytes_per_dimension(tmp_path):
    reference, out = tmp_path / "single", tmp_path / "hsdp"
    distft("train", *PARITY, *GLOBAL_BATCH, "--out", str(reference))
    proc = distft(
        "train", "--strategy", "hsdp", "--nproc", str(WORLD), f"parallel.shard={SHARD}", *PARITY,
        *GLOBAL_BATCH, "--checkpoint-every", "1", "--out", str(out),
    )  # fmt: skip
    assert "global batch 8 = micro-batch 1 x accumulation 2 x data-parallel ranks 4" in proc.stdout
    assert_same_training(out, reference)

    first, want = metrics(out)[0], expected_by_dim()
    assert first["comm_bytes_by_dim"] == first["comm_bytes_expected_by_dim"] == want
    assert first["comm_bytes"] == first["comm_bytes_expected"]

    # DCP reshards the 2D (Replicate, Shard) DTensors: step 1's checkpoint resumes in one process,
    # the saved config's shard groups left behind (single does not take them), and says so.
    out = crashed_copy(out, tmp_path / "crashed", 1)
    proc = distft("train", "--resume", str(out), "--strategy", "single", "--nproc", "1")
    assert "resumed under --strategy single: parallel.shard=2 reset to 0" in proc.stdout
    assert_same_training(out, reference)

    # HSDP x TP on 8 ranks (2 replicas of a shard group of 2 TP groups of 2) against the same
    # reference: every byte on its dimension as planned, then its step-1 checkpoint (3D DTensors)
    # resumed as plain HSDP on 4 ranks, the TP degree left behind.
    out = tmp_path / "hsdp+tp"
    proc = distft(
        "train", "--strategy", "hsdp+tp", "--nproc", "8", "parallel.tp=2", f"parallel.shard={SHARD}", *PARITY,
        *GLOBAL_BATCH, "--checkpoint-every", "1", "--out", str(out),
    )  # fmt: skip
    assert "flattened" not in proc.stderr  # the flattened "dp" kept beside the mesh, not sliced from it
    assert_same_training(out, reference)
    first, ranks = metrics(out)[0], json.loads((out / "ranks.json").read_text())
    assert ranks[0]["predicted_by"].startswith("HSDP x TP (tp=2, shard=2, replicas=2) on 8 processes")
    assert first["comm_bytes_by_dim"] == first["comm_bytes_expected_by_dim"]
    assert set(first["comm_bytes_by_dim"]) == {"shard", "replicate", "tp", "dp", "world"}
    assert ranks[5]["mesh"] == {"replicate": [1, 5], "shard": [5, 7], "tp": [4, 5], "dp": [1, 3, 5, 7]}
    out = crashed_copy(out, tmp_path / "hsdp+tp crashed", 1)
    proc = distft("train", "--resume", str(out), "--strategy", "hsdp", "--nproc", str(WORLD))
    assert "resumed under --strategy hsdp: parallel.tp=2 reset to 1" in proc.stdout
    assert_same_training(out, reference)


@pytest.mark.parametrize(
    "argv,phrase",
    [
        (["--strategy", "hsdp", "--nproc", "4", "parallel.shard=4"], "it is plain FSDP"),  # set, not derived
        (["--strategy", "hsdp", "--nproc", "4", "parallel.shard=3"], "must divide the 4 processes"),
        (["--strategy", "hsdp", "--nproc", "4", "parallel.shard=1"], "shards nothing"),
        (["--strategy", "fsdp", "--nproc", "4", "parallel.shard=2"], "does not take it"),
        (
            ["--strategy", "hsdp+tp", "--nproc", "4", "parallel.tp=2", "parallel.shard=2"],
            "it is --strategy fsdp+tp",
        ),
        (["--strategy", "hsdp+tp", "--nproc", "4", "parallel.tp=1"], "is plain hsdp"),
    ],
)
def test_bad_shard_degree_is_refused_before_launch(argv, phrase, tmp_path, capsys):
    assert main(["train", "--model", "micro", *argv, "--out", str(tmp_path / "refused")]) == 2
    assert phrase in capsys.readouterr().err
