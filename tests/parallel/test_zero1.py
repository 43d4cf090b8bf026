"""ZeRO-1 on 2 gloo processes trains exactly like one process, moves the bytes it should, and its
partitioned optimizer state resumes elsewhere.

One launch: `distft train --strategy zero1 --nproc 2` with a checkpoint after step 2. Its losses,
gradient norms and adapter equal the single-process reference; its first step moved DDP's
all-reduce of the gradients plus one broadcast of every trainable weight (each rank's partition,
one flat bucket each). Then the checkpoint, in which each rank wrote only its own partition's AdamW
state, resumes in one process (`--strategy single`) and finishes the run like the reference: every
parameter's state was found. (The bitwise resume at the same world size: tests/test_reliability.py.)
A second, in-process test checks that fused AdamW (what `setup.adamw` asks for on CUDA) runs on
each rank's partition and updates the weights bit for bit as one fused AdamW over all of them.
"""

import torch

from distft.config import load_config
from distft.distributed import DistEnv
from distft.model import apply_method, load_base_model
from distft.parallel.zero1 import ZeRO1
from tests.helpers import PARITY, assert_same_training, crashed_copy, distft, metrics
from tests.parallel.test_collectives import run_group

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
    out = crashed_copy(out, tmp_path / "crashed", 2)
    proc = distft("train", "--resume", str(out), "--strategy", "single", "--nproc", "1")
    assert "resuming from" in proc.stdout and "step 2" in proc.stdout
    assert_same_training(out, reference)


def _fused_step(rank: int, world: int) -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, 3)) for n in (5, 4, 3, 2)]  # 2 tensors per rank
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    strategy = ZeRO1(
        load_config(None, ["parallel.strategy=zero1"]),
        DistEnv(rank, world, rank, torch.device("cpu"), "gloo"),
    )
    zero = strategy.build_optimizer(params, torch.optim.AdamW, lr=0.1, fused=True)
    plain = torch.optim.AdamW(reference, lr=0.1, fused=True)
    local = strategy.local_optimizer(zero)
    assert local.defaults["fused"] and local.param_groups[0]["fused"]
    for p, q in zip(params, reference, strict=True):
        p.grad = torch.full_like(p, 0.5) * (1 + torch.arange(p.shape[0])[:, None])
        q.grad = p.grad.clone()
    zero.step()
    plain.step()
    assert len(local.state) == 2  # this rank's partition only
    for p, q in zip(params, reference, strict=True):  # every weight, updated by its owner, broadcast
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_fused_adamw_runs_on_each_partition():
    """The flag `setup.adamw` sets on CUDA (fused=True) reaches each rank's AdamW, whose updates,
    broadcast, equal one fused AdamW over every tensor (torch has a fused CPU kernel too)."""
    run_group(_fused_step)
