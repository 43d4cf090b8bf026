"""Model families through the strategies: the same training as one process, and a resume.

For each family's micro preset (Qwen3's `micro` is covered strategy by strategy in the other files
of this folder), the single-process reference trains 2 steps and checkpoints step 1. Then a
strategy, on real gloo groups, resumes a copy of that run from its step-1 checkpoint
and trains step 2: its loss, gradient norm and exported adapter must equal the reference's
(`assert_same_training`), and its collectives must move exactly the bytes of the strategy's
formula (`comm_bytes_expected`). One launch per pair thus proves three things for the family: the
strategy loads a checkpoint into its own layout (DCP reshards the single process's state), trains
a step like one process (Adam's second step, which moves each adapter element by its own gradient
history), and moves the bytes predicted. What the families make different, each exercised here:
untied heads (llama, mistral) in FSDP's root unit and on the last pipeline stage, Llama 3.1's
rope scaling in every stage and in the Megatron layers, Qwen2's q/k/v biases sharded with their
columns, and no q/k norms in the tensor-parallel plans.

Which pairs run (`PAIRS`): each family through the strategies whose own code meets what sets it
apart from Qwen3: the hand-written Megatron layers (`tp-sp`) for all three; an untied head in
FSDP's root unit (`fsdp`) and on the last pipeline stage (`pp`) for llama (mistral's layer is
llama's without the rope scaling); q/k/v biases through the DTensor plan (`tp`) for qwen2. The other strategies are compositions of these
pieces with family-blind collectives, run on Qwen3 in the other files. Every family through every
registered strategy passes too (36 launches, about 2 minutes on two cores), but does not fit the
suite's 10-minute budget: widen `PAIRS` to run it.
"""

from __future__ import annotations

import shutil

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
# Where each family's differences meet a strategy's own code (the module docstring says which).
WHERE_IT_DIFFERS = {
    "llama": ("fsdp", "tp-sp", "pp"),
    "qwen2": ("tp-sp", "tp"),
    "mistral": ("fsdp", "tp-sp", "pp"),
}
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
# PARITY's batch (global 4 = micro 1 x accumulation x ranks), over 2 steps of shorter rows; no
# base weights written: the adapters are compared as tensors.
SETTINGS = [
    *(a for a in PARITY if a not in ("--model", "micro", "train.max_steps=3", "data.max_length=384")),
    "train.max_steps=2",
    "data.max_length=256",
    "output.save_base=false",
]


PAIRS = [(FAMILY_PRESETS[family], s) for family, strategies in WHERE_IT_DIFFERS.items() for s in strategies]


def test_every_family_and_strategy_has_parity_coverage():
    """A new family (or strategy) fails here until it has a preset in this file's parity runs and
    the strategies where it differs."""
    assert set(FAMILY_PRESETS) == set(FAMILIES)
    assert all(PRESETS[name].family == family for family, name in FAMILY_PRESETS.items())
    assert set(NPROC) == set(STRATEGIES) - {"single"}
    assert set(WHERE_IT_DIFFERS) == set(FAMILIES) - {"qwen3"}
    assert all("tp-sp" in strategies for strategies in WHERE_IT_DIFFERS.values())  # hand-written layers


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The single-process run of each family (2 steps, a checkpoint after step 1), trained on first use."""
    runs = {}

    def reference(model: str):
        if model not in runs:
            runs[model] = tmp_path_factory.mktemp(f"{model}-single")
            distft("train", "--model", model, *SETTINGS, "--checkpoint-every", "1", "--out", str(runs[model]))
        return runs[model]

    return reference


@pytest.mark.parametrize(("model", "strategy"), PAIRS)
def test_resumes_and_trains_like_one_process(model, strategy, references, tmp_path):
    reference = references(model)
    # The run as a crash during step 2 leaves it: step 1's checkpoint and record, no adapter.
    out = tmp_path / "run"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("adapter"))
    (out / "metrics.jsonl").write_text((reference / "metrics.jsonl").read_text().splitlines()[0] + "\n")

    layout = ["--strategy", strategy, "--nproc", str(NPROC[strategy]), *LAYOUTS.get(strategy, [])]
    proc = distft("train", "--resume", str(out), *layout)
    assert "resuming from" in proc.stdout and "(step 1)" in proc.stdout
    assert_same_training(out, reference)
    step_2 = metrics(out)[1]
    assert step_2["comm_bytes"] == step_2["comm_bytes_expected"]
