"""Every model family through every strategy: the same training as one process.

For each family's micro preset (Qwen3's `micro` is covered strategy by strategy in the other
files of this folder) every registered strategy trains on real gloo groups and must match the
single-process reference on the same global batch (`assert_same_training`: per-step losses,
gradient norms and the exported adapter), and move exactly the bytes its analytic formula
predicts (`comm_bytes_expected`). ddp, fsdp, tp-sp and pp also resume a checkpoint of the run
and end as the uninterrupted one did. What differs between the families is what this exercises:
untied heads (llama, mistral) in FSDP's root unit and on the last pipeline stage, Llama 3.1's
rope scaling in every stage and in the Megatron layers, Qwen2's q/k/v biases sharded with their
columns, and no q/k norms in the tensor-parallel plans.
"""

from __future__ import annotations

import pytest

from distft.model import PRESETS
from distft.model.families import FAMILIES
from distft.parallel.registry import STRATEGIES
from tests.helpers import PARITY, assert_same_training, distft, metrics

# The parity preset of each family ("micro" is Qwen3's, tested by the other files here).
FAMILY_PRESETS = {
    "qwen3": "micro",
    "llama": "llama-micro",
    "qwen2": "qwen2-micro",
    "mistral": "mistral-micro",
}
UNDER_TEST = [name for family, name in FAMILY_PRESETS.items() if family != "qwen3"]
# The 2-D and 3-D layouts on the fewest ranks that are not a 1-D strategy (4 where both
# dimensions must be 2; fsdp+tp runs on one FSDP rank, as test_fsdp_pp's 3D case does).
LAYOUTS = {
    "hsdp": ["parallel.shard=2"],
    "fsdp+tp": ["parallel.dp=1", "parallel.tp=2"],
    "ddp+pp": ["parallel.dp=2", "parallel.pp=2"],
    "fsdp+pp": ["parallel.dp=2", "parallel.pp=2"],
    "fsdp+tp+pp": ["parallel.dp=1", "parallel.tp=2", "parallel.pp=2"],
}
NPROC = {
    name: 2 if name == "fsdp+tp" or name not in LAYOUTS else 4 for name in STRATEGIES if name != "single"
}
RESUMED = ("ddp", "fsdp", "tp-sp", "pp")
# PARITY's batch (global 4 = micro 1 x accumulation x ranks), over 2 steps of shorter rows (after
# one, Adam has moved every adapter element by about the learning rate, whatever its gradient); no
# base weights written: the adapters are compared as tensors.
SETTINGS = [
    *(a for a in PARITY if a not in ("--model", "micro", "train.max_steps=3", "data.max_length=384")),
    "train.max_steps=2",
    "data.max_length=256",
    "output.save_base=false",
]


def test_every_family_and_strategy_has_parity_coverage():
    """A new family (or strategy) fails here until it has a preset in this file's parity runs."""
    assert set(FAMILY_PRESETS) == set(FAMILIES)
    assert all(PRESETS[name].family == family for family, name in FAMILY_PRESETS.items())
    assert set(NPROC) == set(STRATEGIES) - {"single"}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The single-process run of each family, trained on first use."""
    runs = {}

    def reference(model: str):
        if model not in runs:
            runs[model] = tmp_path_factory.mktemp(f"{model}-single")
            distft("train", "--model", model, *SETTINGS, "--out", str(runs[model]))
        return runs[model]

    return reference


@pytest.mark.parametrize("strategy", list(NPROC))
@pytest.mark.parametrize("model", UNDER_TEST)
def test_matches_single_process(model, strategy, references, tmp_path):
    reference = references(model)
    out = tmp_path / "run"
    resumed = strategy in RESUMED
    args = ["--strategy", strategy, "--nproc", str(NPROC[strategy]), "--model", model, *SETTINGS]
    args += LAYOUTS.get(strategy, [])
    distft("train", *args, *(["--checkpoint-every", "1"] if resumed else []), "--out", str(out))
    assert_same_training(out, reference)
    first = metrics(out)[0]
    assert first["comm_bytes"] == first["comm_bytes_expected"]
    if resumed:  # a crash during step 2 (the last step writes no checkpoint): resume from step 1's
        records = (out / "metrics.jsonl").read_text().splitlines()[:1]
        (out / "metrics.jsonl").write_text("".join(line + "\n" for line in records))
        proc = distft("train", "--resume", str(out))
        assert "resuming from" in proc.stdout
        assert_same_training(out, reference)
