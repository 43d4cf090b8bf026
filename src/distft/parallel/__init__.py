"""Parallel strategies. `STRATEGIES` is the only place the training loop looks one up."""

from __future__ import annotations

from distft.parallel.base import Strategy
from distft.parallel.ddp import DDP
from distft.parallel.ddp_pp import DDPPipelineParallel
from distft.parallel.fsdp import FSDP, ZeRO2
from distft.parallel.fsdp_tp import FSDPTensorParallel
from distft.parallel.megatron import MegatronTPSP
from distft.parallel.pipeline import PipelineParallel
from distft.parallel.single import Single
from distft.parallel.tensor_parallel import TensorParallel

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        Single,
        DDP,
        FSDP,
        ZeRO2,
        TensorParallel,
        MegatronTPSP,
        PipelineParallel,
        FSDPTensorParallel,
        DDPPipelineParallel,
    )
}

__all__ = ["STRATEGIES", "Strategy"]
