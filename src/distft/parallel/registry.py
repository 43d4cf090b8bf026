"""The strategy registry: `STRATEGIES`, name -> class, where the runtime looks up how a strategy
runs. What each one is (its dimensions, capabilities, what it holds and moves) is its spec,
`distft.layout.SPECS`, which the CLI, the checks before launch, the planner and bench read
without importing torch; a test holds the two tables to the same names in the same order.

A new strategy is its spec, one file in this package (a `Strategy` subclass with a `name`) and
one line here."""

from __future__ import annotations

from distft.layout import SPECS
from distft.parallel.base import Strategy
from distft.parallel.context import ContextParallel
from distft.parallel.ddp import DDP
from distft.parallel.ddp_pp import DDPPipelineParallel
from distft.parallel.fsdp import FSDP, ZeRO2
from distft.parallel.fsdp_cp import FSDPContextParallel
from distft.parallel.fsdp_ep import FSDPExpertParallel
from distft.parallel.fsdp_pp import FSDPPipelineParallel
from distft.parallel.fsdp_tp import FSDPTensorParallel
from distft.parallel.fsdp_tp_pp import FSDPTensorPipelineParallel
from distft.parallel.hsdp import HSDP
from distft.parallel.hsdp_tp import HSDPTensorParallel
from distft.parallel.megatron import TensorSequenceParallel
from distft.parallel.pipeline import PipelineParallel
from distft.parallel.single import Single
from distft.parallel.tensor_parallel import TensorParallel
from distft.parallel.zero1 import ZeRO1

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        Single,
        DDP,
        ZeRO1,
        ZeRO2,
        FSDP,
        HSDP,
        TensorParallel,
        TensorSequenceParallel,
        ContextParallel,
        PipelineParallel,
        FSDPTensorParallel,
        DDPPipelineParallel,
        FSDPPipelineParallel,
        FSDPTensorPipelineParallel,
        FSDPContextParallel,
        FSDPExpertParallel,
        HSDPTensorParallel,
    )
}
assert list(STRATEGIES) == list(SPECS), "a strategy's class and its spec: both, in the same order"
