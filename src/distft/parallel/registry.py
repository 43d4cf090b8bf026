"""The strategy registry: `STRATEGIES`, name -> class, the one place any code looks a strategy up.

A new strategy is one file in this package (a `Strategy` subclass with a `name`) and one line here;
the CLI's choices, the checks before launch, the planner's "runs in distft" column and bench all
read this table."""

from __future__ import annotations

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
    )
}


def strategy_table() -> str:
    """The README's table of strategies, one row per registry entry, from each class's own
    description (`holds`, `moves`, `page`): a test keeps the README equal to it."""
    rows = ["| strategy | what each rank holds | collectives per step | docs |", "|---|---|---|---|"]
    for name, cls in STRATEGIES.items():
        page = f"[docs/{cls.page.split('#')[0]}](docs/{cls.page})" if cls.page else ""
        rows.append(f"| `{name}` | {cls.holds} | {cls.moves} | {page} |".replace(" |  |", " | |"))
    return "\n".join(rows)
