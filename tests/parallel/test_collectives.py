"""The four autograd collectives against the dense computation, on 2 gloo processes (one launch).

Each rank holds its piece of a global tensor; forward must give the dense result's piece and
backward the gradient the dense computation gives for that piece. Bytes follow `distft.measure.comm`.
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist

from distft.measure.comm import CommCounter
from distft.parallel.megatron.collectives import (
    all_gather_dim,
    copy_to_tp_region,
    gather_from_sp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
)
from tests.helpers import free_port, spawn

WORLD = 2


def run_group(fn, world: int = WORLD) -> None:
    """Run `fn(rank, world)` in `world` processes joined in a gloo group; fail if any fails."""
    spawn(_init_and_run, (fn, world, free_port()), nprocs=world)


def _init_and_run(rank: int, fn, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        fn(rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # A gloo process sometimes aborts while the interpreter exits ("terminate called without an
    # active exception") after a good run: flush what the test reads, then leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _check_collectives(rank: int, world: int) -> None:
    seq, batch, hidden = 6, 2, 3  # sequence-first activations, seq divisible by world
    chunk = slice(rank * seq // world, (rank + 1) * seq // world)
    per_rank = [rand(seq, batch, hidden, seed=10 + r) for r in range(world)]  # each rank's own tensor
    grads = [rand(seq, batch, hidden, seed=20 + r) for r in range(world)]  # each rank's output grad
    close = torch.testing.assert_close

    with CommCounter() as counter:
        # copy: identity forward; backward sums the ranks' gradients.
        x = per_rank[0].clone().requires_grad_()  # replicated input
        y = copy_to_tp_region(x)
        close(y, per_rank[0])
        y.backward(grads[rank])
        close(x.grad, sum(grads))

        # reduce: forward sums the ranks' partial tensors; backward passes the (replicated) grad.
        x = per_rank[rank].clone().requires_grad_()
        y = reduce_from_tp_region(x)
        close(y, sum(per_rank))
        y.backward(grads[0])
        close(x.grad, grads[0])

        # gather: each rank's sequence chunk -> the full sequence; backward reduce-scatters.
        full = per_rank[0]
        x = full[chunk].clone().requires_grad_()
        y = gather_from_sp_region(x)
        close(y, full)
        y.backward(grads[rank])
        close(x.grad, sum(grads)[chunk])

        # reduce-scatter: partial sums -> this rank's chunk of the sum; backward all-gathers.
        x = per_rank[rank].clone().requires_grad_()
        y = reduce_scatter_to_sp_region(x)
        close(y, sum(per_rank)[chunk])
        y.backward(grads[0][chunk] * (rank + 1))  # a different gradient on each rank
        close(x.grad, torch.cat([grads[0][c] * (r + 1) for r, c in enumerate(_chunks(seq, world))]))

    # Bytes counted as the full logical tensor (comm.py): each of the 8 collectives moved one
    # (seq, batch, hidden) float64 tensor; all-reduce: copy's backward and reduce's forward.
    size = seq * batch * hidden * 8
    assert dict(counter.stats.calls) == {"all_reduce": 2, "all_gather": 2, "reduce_scatter": 2}
    assert dict(counter.stats.bytes) == {
        "all_reduce": 2 * size,
        "all_gather": 2 * size,
        "reduce_scatter": 2 * size,
    }

    # Gathering weight shards along any dimension (export).
    weight = rand(4, 6, seed=3)
    close(all_gather_dim(weight.chunk(world, 1)[rank], 1), weight)
    # The group is still healthy after collectives on tensors that required grad.
    ok = torch.ones(1)
    dist.all_reduce(ok)
    assert ok.item() == world


def _chunks(seq: int, world: int) -> list[slice]:
    return [slice(r * seq // world, (r + 1) * seq // world) for r in range(world)]


def test_collectives_match_dense():
    run_group(_check_collectives)
