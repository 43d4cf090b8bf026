"""A stand-in for `distft.cli` under `distft.launch` (tests/test_launch.py): each rank writes what
it was started with to DIR/rank-RANK.json."""

import json
import os
import sys
from pathlib import Path

KEYS = ("RANK", "TORCHELASTIC_USE_AGENT_STORE", "DISTFT_FORKED_RANK", "TOKENIZERS_PARALLELISM")

if __name__ == "__main__":
    seen = {key: os.environ.get(key) for key in KEYS} | {"parent": os.getppid()}
    Path(sys.argv[1], f"rank-{os.environ['RANK']}.json").write_text(json.dumps(seen))
