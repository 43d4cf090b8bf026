"""Run outputs, written so that a crash never leaves a half-written file where a good one was.

Every directory is written under a temporary name beside its final place and renamed into place
once complete (a rename within one filesystem is atomic), so a reader sees the old version or the
new one, never a mix.

- `DIR/adapter/`: a standard PEFT adapter (adapter_config.json + adapter_model.safetensors) that
  `PeftModel.from_pretrained` loads in a plain Python process, whatever strategy trained it.
- `DIR/model/`: the whole model, for full finetuning (config.json + model.safetensors).
- `DIR/base/`: the randomly initialised base of a preset model, with the tokenizer, so an adapter
  trained on a preset can be loaded anywhere (presets have no weights on the hub).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temporary directory that replaces `final` only if the block completes."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.iterdir():  # data on disk before the rename makes it visible
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_adapter(peft_model: nn.Module, state: dict[str, torch.Tensor], out: Path, base_ref: str) -> None:
    """Write `state` (the trained LoRA weights, peft's full names) as a PEFT adapter in `out`."""
    from peft import get_peft_model_state_dict

    adapter = get_peft_model_state_dict(peft_model, state_dict=state)
    config = peft_model.peft_config["default"]
    config.base_model_name_or_path = base_ref
    with atomic_directory(out) as tmp:
        config.save_pretrained(str(tmp))
        save_file(
            {k: v.contiguous() for k, v in adapter.items()},
            str(tmp / "adapter_model.safetensors"),
            metadata={"format": "pt"},
        )


def save_full_model(lm: nn.Module, state: dict[str, torch.Tensor], out: Path) -> None:
    """Write a fully finetuned model in transformers' layout (tied weights stored once)."""
    with atomic_directory(out) as tmp:
        lm.save_pretrained(str(tmp), state_dict=state)


def save_base(lm: nn.Module, tokenizer: object, out: Path) -> None:
    with atomic_directory(out) as tmp:
        lm.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))


class MetricsWriter:
    """`metrics.jsonl`: one JSON object per logged step, flushed as it is written."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("w", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
