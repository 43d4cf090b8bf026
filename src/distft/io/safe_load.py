"""Reading a checkpoint as data, never code.

Resuming a checkpoint from anyone (a colleague's run, a shared filesystem, a download) must not
run what a planted pickle asks for. DCP pickles two things of its own: its `.metadata`, read here
by `_MetadataUnpickler`, which builds only DCP's metadata classes, torch sizes and dtypes, and
paths; and non-tensor optimizer values (AdamW's settings), read by `SafeLoadPlanner` with
`torch.load(weights_only=True)`. Earlier versions' pickled trainer and RNG files go through
`load_weights_only`. Anything else asked for raises `ForbiddenPickle`.
"""

from __future__ import annotations

import importlib
import io
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta


def load_weights_only(path: Path) -> object:
    """An earlier version's pickle, read by `torch.load(weights_only=True)`: a pickle asking for
    anything but tensors and plain containers is refused (`ForbiddenPickle`), not run."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        if "Weights only load failed" in str(err):
            raise ForbiddenPickle(f"{path.name} asks to build objects that are not checkpoint data") from None
        raise


class ForbiddenPickle(pickle.UnpicklingError):
    """A checkpoint's pickle asks to build something that is not checkpoint data."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and nothing else: a planted `.metadata` asking for any other callable
    (`os.system`, ...) fails to load instead of running it."""

    def find_class(self, module: str, name: str) -> object:
        found = super().find_class(module, name) if _allowed(module, name) else None
        if found is None:
            raise ForbiddenPickle(f"its .metadata asks for {module}.{name}, which is not checkpoint metadata")
        return found


def _allowed(module: str, name: str) -> bool:
    if module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"):
        return isinstance(getattr(importlib.import_module(module), name, None), type)  # classes only
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
    return (module, name) in {
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
    }


def read_metadata(checkpoint: Path) -> Metadata:
    """A checkpoint's DCP `.metadata`, read by `_MetadataUnpickler`."""
    with (checkpoint / ".metadata").open("rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError("its .metadata holds no checkpoint metadata")
    return metadata


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with the metadata read by `_MetadataUnpickler`."""

    def read_metadata(self, *args: object) -> Metadata:  # no **kwargs: no per-rank fallback file
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor values (optimizer settings) read by `weights_only=True`."""

    def load_bytes(self, read_item: object, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
