"""2D parallelism (`fsdp+tp`, dp=2 x tp=2 on 4 gloo processes) trains exactly like one process.

One 4-process run (micro, 2 steps: the slowest test here, ~1 min on 2 shared cores) checks the
losses, gradient norms and exported adapter against the single-process reference on the same
global batch, and every byte each collective moved against the analytic volume. The mesh's
validation runs in process, before any launch.
"""

import pytest

from distft.cli import main
from distft.config import load_config
from distft.errors import ConfigError
from distft.layout import SPECS, ParallelDims
from tests.helpers import PARITY, assert_same_training, distft, metrics

TWO_D = [*PARITY, "train.max_steps=2"]


def test_matches_single_process(tmp_path):
    reference, out = tmp_path / "single", tmp_path / "fsdp+tp"
    distft("train", *TWO_D, "--out", str(reference))
    proc = distft(
        "train", "--strategy", "fsdp+tp", "--nproc", "4", "parallel.dp=2", "parallel.tp=2", *TWO_D,
        "--out", str(out), timeout=400,
    )  # fmt: skip
    # The global batch splits over the 2 data-parallel groups, not the 4 ranks.
    assert "global batch 4 = micro-batch 1 x accumulation 2 x data-parallel ranks 2" in proc.stdout
    assert_same_training(out, reference)
    first = metrics(out)[0]
    # FSDP all-gathers / reduce-scatters TP-local shards over dp, TP all-reduces activations over tp.
    assert first["comm_bytes"] == first["comm_bytes_expected"]
    assert set(first["comm_bytes"]) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_parallel_dims():
    dims = ParallelDims(dp_shard=2, tp=2)
    # tp is the inner dimension: TP groups are neighbouring ranks.
    assert [(c["dp"], c["tp"]) for c in map(dims.coordinates, range(4))] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    wrong = load_config(
        None, ["parallel.strategy=fsdp+tp", "parallel.nproc=4", "parallel.dp=2", "parallel.tp=3"]
    )
    with pytest.raises(ConfigError, match="2 x 3 x 1 = 6, but the run has 4 processes"):
        ParallelDims.of(SPECS["fsdp+tp"], wrong)
    auto = load_config(
        None, ["parallel.strategy=fsdp+tp", "parallel.nproc=8", "parallel.tp=2", "train.micro_batch_size=1"]
    )
    assert ParallelDims.of(SPECS["fsdp+tp"], auto).dp == 4  # dp=0: what tp leaves


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["parallel.dp=3", "parallel.tp=2"], "3 x 2 x 1 = 6, but the run has 4 processes"),
        (["parallel.tp=3"], "does not divide the 4 processes"),
        (["parallel.tp=1"], "use --strategy fsdp"),
        (["parallel.tp=2", "parallel.pp=2", "parallel.dp=1"], "reserved for pipeline strategies"),
        # micro has 4 query heads and 2 KV heads: 4 TP ranks cannot split them.
        (["parallel.tp=4"], "4 query heads and 2 KV heads"),
    ],
)
def test_refused_before_launch(args, expected, capsys, tmp_path):
    cmd = ["train", "--model", "micro", "--strategy", "fsdp+tp", "--nproc", "4", *args]
    assert main([*cmd, "train.micro_batch_size=1", "--out", str(tmp_path)]) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "config.toml").exists()


def test_one_dimensional_strategies_take_no_degrees(capsys):
    assert main(["train", "--strategy", "fsdp", "--nproc", "2", "parallel.tp=2"]) == 2
    assert "takes its layout from --nproc alone" in capsys.readouterr().err
