"""A stand-in for `distft.cli` under `distft.launch` (tests/test_launch.py): each rank runs an
operation large enough for torch to go parallel (a forked rank hangs there when the process it
was forked from left it a pool of OpenMP threads), then writes what it was started with, and its
thread count, to DIR/rank-RANK.json."""

import json
import os
import sys
from pathlib import Path

import torch

KEYS = ("RANK", "TORCHELASTIC_USE_AGENT_STORE", "DISTFT_FORKED_RANK", "TOKENIZERS_PARALLELISM")

if __name__ == "__main__":
    torch.randperm(1_000_000, generator=torch.Generator().manual_seed(0))
    seen = {key: os.environ.get(key) for key in KEYS} | {
        "parent": os.getppid(),
        "threads": torch.get_num_threads(),
    }
    Path(sys.argv[1], f"rank-{os.environ['RANK']}.json").write_text(json.dumps(seen))
