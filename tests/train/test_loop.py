"""The end of `train`: what a rank lets go of, and in which order."""

import gc

import pytest
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from distft.config import load_config
from distft.train import train
from tests.helpers import PARITY, in_forked_process


def _wrappers_alive_when_the_group_goes(strategy: str, out: str) -> list[int]:
    """Train as one rank of `strategy` (a group of one); at each `destroy_process_group`, how many
    DDP wrappers still exist, cyclic garbage included (it is freed whenever the collector runs)."""
    counts = []
    destroy = dist.destroy_process_group

    def counting(*args, **kwargs):
        counts.append(sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects()))
        return destroy(*args, **kwargs)

    dist.destroy_process_group = counting
    overrides = [a for a in PARITY if "=" in a]
    train(
        load_config(
            None, ["model.name=micro", *overrides, f"parallel.strategy={strategy}", f"output.dir={out}"]
        )
    )
    return counts


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_the_parallel_model_goes_before_the_process_group(strategy, tmp_path):
    """DDP's C++ reducer holds the process group. Were its reference the last, freeing the model
    would destroy gloo's threads with the GIL held while one of them waits for the GIL: a rank
    that hangs after a good run. So no wrapper may outlive the group's destruction."""
    assert in_forked_process(_wrappers_alive_when_the_group_goes, strategy, str(tmp_path / "run")) == [0]
