"""ZeRO-1 on 2 gloo processes trains exactly like one process, moves the bytes it should, and its
partitioned optimizer state resumes elsewhere.

One launch: `distft train --strategy zero1 --nproc 2` with a checkpoint after step 2. Its losses,
gradient norms and adapter equal the single-process reference; its first step moved DDP's
all-reduce of the gradients plus one broadcast of every trainable weight (each rank's partition,
one flat bucket each). Then the checkpoint, in which each rank wrote only its own partition's AdamW
state, resumes in one process (`--strategy single`) and finishes the run like the reference: every
parameter's state was found. (The bitwise resume at the same world size: tests/test_reliability.py.)
"""

import torch

from distft.config import load_config
from distft.model import apply_method, load_base_model
from tests.helpers import PARITY, assert_same_training, distft, metrics

WORLD = 2


def trainable_bytes() -> int:
    """The micro model's LoRA adapters (fp32), as every rank holds them."""
    cfg = load_config(None, ["model.name=micro"])
    torch.manual_seed(0)
    model = apply_method(load_base_model(cfg.model), cfg)
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def test_matches_single_process_and_resumes_in_one(reference, tmp_path):
    out = tmp_path / "zero1"
    distft(
        "train", "--strategy", "zero1", "--nproc", str(WORLD), *PARITY, "--checkpoint-every", "2",
        "--out", str(out),
    )  # fmt: skip
    assert_same_training(out, reference)

    first = metrics(out)[0]
    weights = trainable_bytes()  # = the gradients' bytes: fp32 adapters, fp32 gradients
    # DDP's all-reduce of the gradients and of the loss (fp32); the broadcasts of updated weights.
    expected = {"all_reduce": weights + 4, "broadcast": weights}
    assert first["comm_bytes"] == first["comm_bytes_expected"] == expected
    assert first["comm_calls"]["broadcast"] == WORLD  # one flat bucket per rank's partition

    # The run crashed after step 2: resume its checkpoint in one process and train on.
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("".join(line + "\n" for line in lines[:2]))
    proc = distft("train", "--resume", str(out), "--strategy", "single", "--nproc", "1")
    assert "resuming from" in proc.stdout and "step 2" in proc.stdout
    assert_same_training(out, reference)
