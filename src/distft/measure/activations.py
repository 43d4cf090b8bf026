"""Measuring the activation memory a forward pass keeps for backward.

Autograd calls a pack hook for every tensor an op saves for its backward. Counting the distinct
storages behind those tensors, minus the storages of parameters (weights saved by matmuls are
not activations; under FSDP they are the gathered copies, registered on the module while it
runs), gives the bytes of activations this rank holds between forward and backward: the number
that sequence parallelism divides by N and that activation checkpointing trades for compute.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    if isinstance(t, DTensor):
        t = t._local_tensor
    if isinstance(t, AsyncCollectiveTensor):
        # DTensor's all-reduced outputs (e.g. what a row-parallel LoRA's lora_B saves) are wrappers
        # without a storage of their own; the tensor they wrap holds the bytes.
        t = t.elem
    return t.untyped_storage()


def _data_ptrs(t: torch.Tensor) -> list[int]:
    """Storages behind a parameter; a wrapper subclass (QLoRA's NF4Tensor) has none of its own,
    its data lives in inner tensors."""
    t = t._local_tensor if isinstance(t, DTensor) else t
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [ptr for name in names for ptr in _data_ptrs(getattr(t, name))]
    try:
        return [t.untyped_storage().data_ptr()]
    except RuntimeError:  # a storage dynamo swapped out while tracing a compiled block: none to skip
        return []


class SavedActivations:
    """`with SavedActivations(model) as probe: loss = model(...)`; then `probe.bytes`."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.bytes = 0
        self._saved: dict[int, tuple[int, StorageWeakRef]] = {}  # storage pointer -> (bytes, the storage)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        # Every module's parameter dict, found once: walking the module tree at every pack costs
        # (modules x saved tensors), over a second on the first step of a 36-layer model.
        self._parameter_dicts = [m._parameters for m in model.modules()]
        # And the parameters' storages as they are now: peft's adapters on a parameter (an MoE's
        # expert stacks) move it into a parametrization module for the forward, out of those dicts.
        self._parameters = {ptr for p in model.parameters() for ptr in _data_ptrs(p)}

    def _parameter_storages(self) -> set[int]:
        # Read at pack time: FSDP swaps gathered parameters in and out of these dicts.
        return self._parameters | {
            ptr
            for parameters in self._parameter_dicts
            for p in parameters.values()
            if p is not None
            for ptr in _data_ptrs(p)
        }

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = _storage(t)
        try:
            ptr = storage.data_ptr()
        except RuntimeError:  # fake/meta tensors DTensor makes while propagating shardings
            return t
        held = self._saved.get(ptr)
        if (held is None or held[1].expired()) and storage.nbytes() and ptr not in self._parameter_storages():
            self._saved[ptr] = (storage.nbytes(), StorageWeakRef(storage))  # new, or freed and reused
        return t

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        """Count what backward will find: the saved storages still alive as the forward ends. A
        graph the forward built and dropped (peft's check of a parametrization it registers, say)
        saved tensors too, freed since."""
        self._hooks.__exit__(*exc)
        self.bytes = sum(n for n, storage in self._saved.values() if not storage.expired())
        self._saved.clear()
