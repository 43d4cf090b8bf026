"""Golden losses: the training paths that no outside reference holds, pinned to committed numbers.

Most of the suite compares a strategy with the single process, and the single process is itself held
to an outside reference on the paths below it: its summed loss and gradients to transformers' own
loss and to the plain transformers+peft loop (tests/model/test_loss.py, tests/bench/), the DPO, ORPO
and KTO losses to TRL's functions (tests/model/test_preference.py), the router's losses to
transformers' (tests/model/test_router.py), each checkpointing level and MLP tiling to the eager
gradients (tests/model/test_checkpointing.py), NF4 to its formula (tests/model/test_qlora.py).
What none of those sees is a path's whole run: a change to the shared code that moves the single
process moves every parity test's reference with it. So each path below trains a fixed micro run,
and its per-step losses and gradient norms must equal the committed file's (`GOLDEN`):

- qlora: NF4 base weights, fp32 adapters;
- full-fp32-masters: full finetuning of a bf16 model over fp32 master weights (autocast);
- dpo, orpo, kto: the preference objectives as trained (DPO's reference scored by the disabled
  adapters, ORPO's odds term, KTO's KL estimate);
- moe: the mixture-of-experts preset, its router's auxiliary losses included;
- long-context: YaRN positions, activations offloaded to host memory, the MLP in tiles.

A change that moves these numbers on purpose rewrites the file, and says why in its commit:

    .venv/bin/python -m tests.golden

The tolerance (`RTOL`) is what CPU numerics allow between machines of one kind (the same run on
this one is bit-equal); a planted 1.001x on any of these paths exceeds it.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests.helpers import distft, metrics, write_jsonl
from tests.parallel.test_preference import pair_rows, unpaired_rows

GOLDEN = Path(__file__).with_name("golden.json")
RTOL = 1e-5
FIELDS = ("loss", "grad_norm")
STEPS = 4
COMMON = [
    "--model", "micro",
    f"train.max_steps={STEPS}",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
    "train.eval_every=0",
    "train.eval_batches=0",
    "data.max_length=256",  # a bundled meeting's summary and the prompt's head fit
    "data.max_rows=32",
    "optim.warmup_steps=1",
    "optim.lr=1e-3",
    "output.save_base=false",
]  # fmt: skip
RUNS: dict[str, list[str]] = {
    "qlora": ["--method", "qlora", "model.quant_scaler_block_size=4"],
    "full-fp32-masters": ["--method", "full", "model.dtype=bfloat16", "train.master_weights=fp32"],
    "dpo": ["--objective", "dpo", "--data", "{pairs}", "data.max_length=128"],
    "orpo": ["--objective", "orpo", "--data", "{pairs}", "data.max_length=128"],
    "kto": ["--objective", "kto", "--data", "{unpaired}", "data.max_length=128"],
    "moe": ["--model", "qwen3-moe-micro"],
    "long-context": [
        "model.rope_scaling=yarn",
        "model.rope_factor=4",
        "model.activation_checkpointing=offload",
        "model.mlp_tiles=2",
    ],
}


def train(name: str, folder: Path) -> list[dict[str, float]]:
    """Run `name` in `folder` (its data files written there): each step's `FIELDS`."""
    data = {
        "pairs": write_jsonl(folder / "pairs.jsonl", pair_rows()),
        "unpaired": write_jsonl(folder / "unpaired.jsonl", unpaired_rows()),
    }
    args = [arg.format(**data) for arg in RUNS[name]]
    distft("train", *COMMON, *args, "--out", str(folder / "run"))
    return [{field: record[field] for field in FIELDS} for record in metrics(folder / "run")]


def read() -> dict[str, list[dict[str, float]]]:
    return json.loads(GOLDEN.read_text())["runs"]


def write() -> None:
    """Train every run and write `GOLDEN` (the numbers, and how they were made)."""
    runs = {}
    for name in RUNS:
        with tempfile.TemporaryDirectory(prefix=f"golden-{name}-") as tmp:
            runs[name] = train(name, Path(tmp))
        print(name, runs[name][-1], file=sys.stderr)
    made = "written by `.venv/bin/python -m tests.golden` (tests/golden.py: the runs and why)"
    lines = [
        f'  "{name}": [\n' + ",\n".join(f"   {json.dumps(step)}" for step in steps) + "\n  ]"
        for name, steps in runs.items()
    ]
    GOLDEN.write_text(f'{{\n "made": {json.dumps(made)},\n "runs": {{\n' + ",\n".join(lines) + "\n }\n}\n")


if __name__ == "__main__":
    write()
