"""Counting the bytes every collective moves, whoever issues it.

Strategies issue collectives from very different places: DDP from its C++ reducer during backward,
FSDP2 from its pre-forward and post-backward hooks, tensor parallelism from DTensor redistributions
and our own autograd functions, pipelines through point-to-point sends. Patching
`torch.distributed`'s Python functions misses most of these. What they all share is the dispatcher:
each ends up as a `c10d` op (or a functional-collective op), so a `TorchDispatchMode` sees all of
them, on every thread the autograd engine uses for this process.

Sizes follow one convention, the size of the whole logical tensor:
- all-reduce: the reduced tensor;
- all-gather: the gathered (full) output;
- reduce-scatter: the full input before it is scattered;
- broadcast, send, recv: the tensor sent or received.
A ring algorithm moves (N-1)/N of that per rank for all-gather and reduce-scatter and 2(N-1)/N for
all-reduce; `wire_bytes` applies those factors.

Each collective is also credited to the process group it ran over (`CommStats.by_dim`), named by
its mesh dimension: a `DeviceMesh` names its groups `mesh_<dim>` ("shard", "replicate", "dp",
"tp", ...), the default group is "world", any other group is named by its ranks. On a 2D mesh
that splits the bytes per dimension, e.g. HSDP's all-gathers inside a node from its all-reduce
across nodes, which run over links ten times apart in speed.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._ops import HigherOrderOperator
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# op name (without overload) -> (kind, which argument holds the logical tensor(s))
_OPS: dict[str, tuple[str, str]] = {
    # c10d ops behind torch.distributed (the ProcessGroup API; DDP, FSDP2, gloo, NCCL)
    "c10d.allreduce_": ("all_reduce", "arg0"),
    "c10d.allreduce_coalesced_": ("all_reduce", "arg0"),
    "c10d.allgather_": ("all_gather", "arg0"),  # output tensor lists
    "c10d._allgather_base_": ("all_gather", "arg0"),  # output tensor
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", "arg0"),
    "c10d.allgather_coalesced_": ("all_gather", "arg0"),
    "c10d.reduce_scatter_": ("reduce_scatter", "arg1"),  # input tensor lists
    "c10d._reduce_scatter_base_": ("reduce_scatter", "arg1"),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", "arg1"),
    "c10d.broadcast_": ("broadcast", "arg0"),
    "c10d.send": ("send", "arg0"),
    "c10d.recv_": ("recv", "arg0"),
    "c10d.alltoall_base_": ("all_to_all", "arg1"),
    # functional collectives (DTensor / tensor parallelism)
    "_c10d_functional.all_reduce": ("all_reduce", "arg0"),
    "_c10d_functional.all_reduce_": ("all_reduce", "arg0"),
    "_c10d_functional.all_reduce_coalesced": ("all_reduce", "arg0"),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", "out"),
    "_c10d_functional.all_gather_into_tensor_coalesced": ("all_gather", "out"),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", "arg0"),
    "_c10d_functional.reduce_scatter_tensor_coalesced": ("reduce_scatter", "arg0"),
    "_c10d_functional.all_to_all_single": ("all_to_all", "arg0"),
    "_c10d_functional.broadcast": ("broadcast", "arg0"),
}

WIRE_FACTOR = {  # per-rank bytes on the wire per logical byte, ring algorithms, N ranks
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
}


def _nbytes(obj: object) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, list | tuple):
        return sum(_nbytes(o) for o in obj)
    return 0


def group_dimension(args: tuple) -> str:
    """The mesh dimension a collective's process group spans ("world": the default group)."""
    for arg in args:  # c10d ops carry the group itself (and a ReduceOp, which does not unbox)
        if isinstance(arg, torch.ScriptObject):
            try:
                return _dimension(dist.ProcessGroup.unbox(arg))
            except RuntimeError:
                continue
    names = [arg for arg in args if isinstance(arg, str)]  # functional ops: the group's name, last
    try:
        return _dimension(_resolve_process_group(names[-1])) if names else "unknown"
    except (ValueError, RuntimeError):  # a name no group answers to: counting must not stop a run
        return "unknown"


def _dimension(group: dist.ProcessGroup) -> str:
    desc = group.group_desc
    if desc == "default_pg":
        return "world"
    if desc.startswith("mesh_"):
        return desc.removeprefix("mesh_")
    return "ranks " + ",".join(map(str, dist.get_process_group_ranks(group)))


@dataclass
class CommStats:
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    by_dim: dict[str, dict[str, int]] = field(default_factory=dict)  # dimension -> kind -> bytes

    def add(self, kind: str, nbytes: int, dim: str) -> None:
        self.bytes[kind] += nbytes
        self.calls[kind] += 1
        per_kind = self.by_dim.setdefault(dim, {})
        per_kind[kind] = per_kind.get(kind, 0) + nbytes

    def wire_bytes(self, world_size: int) -> float:
        return sum(WIRE_FACTOR[k](world_size) * b for k, b in self.bytes.items())


class CommCounter(TorchDispatchMode):
    """`with CommCounter() as c: ...` then `c.stats` holds bytes and calls per collective kind."""

    def __init__(self) -> None:
        super().__init__()
        self.stats = CommStats()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Without this, dynamo refuses to trace while the mode is active and marks the compiled
        # blocks skipped for the rest of the process: compile silently off under every measured
        # strategy. Collectives never run inside a compiled block (FSDP's hooks and DDP's reducer
        # stay eager), so the counts are unchanged; the ops inside the compiled graphs are not seen.
        return True

    # FlexAttention is a higher-order operator: run eagerly under the mode (the CPU's evaluation,
    # a compile fallback) it reaches `__torch_dispatch__` as one op, computed, never a collective.
    supports_higher_order_operators = True

    def reset(self) -> CommStats:
        stats, self.stats = self.stats, CommStats()
        return stats

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # Let tensor subclasses (DTensor) run first; the collectives they issue while
            # redistributing come back through this mode as plain-tensor ops and are counted.
            return NotImplemented
        kwargs = kwargs or {}
        start = time.perf_counter()
        out = func(*args, **kwargs)
        end = time.perf_counter()
        entry = _ENTRIES.get(func, _UNSEEN)
        if entry is _UNSEEN:
            hop = isinstance(func, HigherOrderOperator)
            entry = _ENTRIES[func] = None if hop else _OPS.get(f"{func.namespace}.{func._opname}")
        if entry is None:
            self.on_op(func, args, start, end)
        else:
            kind, where = entry
            source = out if where == "out" else args[int(where[3:])]
            self.stats.add(kind, _nbytes(source), group_dimension(args))
            self.on_collective(func, args, kwargs, out, start, end)
        return out

    # Hooks for `distft.measure.overlap.CommTimeline` (timestamps); nothing to do when counting.
    def on_op(self, func, args: tuple, start: float, end: float) -> None:
        """Any other op ran from `start` to `end` (perf_counter seconds)."""

    def on_collective(self, func, args: tuple, kwargs: dict, out: object, start: float, end: float) -> None:
        """A collective's op ran from `start` to `end`; `out` is what it returned."""


_UNSEEN = object()
_ENTRIES: dict = {}  # op overload -> its _OPS entry or None (the name, formatted once per op)
