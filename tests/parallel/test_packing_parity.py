"""Packed runs train exactly like padded ones: single, ddp, tp-sp and pp against one padded process.

`data.packing` is on by default; the reference here turns it off. Two sequences per micro-batch
and `data.max_length=768` (the bundled meetings run ~500 tokens), so padded micro-batches really
carry padding and packed rows really hold two documents. Per-step losses, gradient norms and the
exported adapter must agree to 1e-5 (float summation order: a packed row sums its attention and
its matmuls in another order than padded rows).
"""

import pytest

from tests.helpers import adapter, assert_same_training, distft, metrics

PACKING = [
    "--model", "micro",
    "train.max_steps=3",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.eval_every=0",
    "train.eval_batches=1",
    "data.max_length=768",
    "data.max_rows=32",
    "optim.warmup_steps=1",
    "optim.lr=1e-3",
]  # fmt: skip


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """One process, one right-padded row per sequence: the reference."""
    out = tmp_path_factory.mktemp("padded")
    distft("train", *PACKING, "data.packing=false", "--out", str(out))
    return out


@pytest.mark.parametrize(
    "launch",
    [
        [],  # single
        ["--strategy", "ddp", "--nproc", "2"],  # 1 packed micro-batch per rank
        ["--strategy", "tp-sp", "--nproc", "2"],  # its own mask and positions (megatron/model.py)
        ["--strategy", "pp", "--nproc", "2", "parallel.schedule=gpipe", "parallel.microbatches=2"],
    ],
    ids=["single", "ddp", "tp-sp", "pp"],
)
def test_packed_trains_like_padded(launch, padded, tmp_path):
    out = tmp_path / "packed"
    distft("train", *launch, *PACKING, "--out", str(out))
    assert_same_training(out, padded)
    assert adapter(out).keys() == adapter(padded).keys()
    # tokens/s counts real tokens, whatever the layout.
    assert [m["tokens"] for m in metrics(out)] == [m["tokens"] for m in metrics(padded)]


def test_packing_moves_fewer_bytes_under_sequence_parallelism(tmp_path):
    """tp-sp gathers every activation along the sequence: a packed row has no padding to move."""
    sent = {}
    for packing in ("true", "false"):
        out = tmp_path / packing
        distft(
            "train",
            "--strategy",
            "tp-sp",
            "--nproc",
            "2",
            *PACKING,
            f"data.packing={packing}",
            "--out",
            str(out),
        )
        sent[packing] = metrics(out)[0]["comm_bytes"]["all_gather"]
    assert sent["true"] < sent["false"]
