"""Model families through every strategy: the same training as one process, and a resume.

For each family's micro preset, the single-process reference trains 2 steps and checkpoints step 1.
Then every registered strategy, on real gloo groups, resumes a copy of that run from its step-1
checkpoint and trains step 2: its loss, gradient norm and exported adapter must equal the
reference's (`assert_same_training`), and its collectives must move exactly the bytes of the
strategy's formula (`comm_bytes_expected`) and of the planner's (`distft plan`'s prediction for the
run). One run per pair thus proves three things for the family: the strategy loads a checkpoint
into its own layout (DCP reshards the single process's state), trains a step like one process
(Adam's second step, which moves each adapter element by its own gradient history), and moves the
bytes predicted. What the families make different meets the strategies' own code: untied heads
(llama, mistral) in FSDP's root unit, the tensor-parallel vocabulary split and the last pipeline
stage; Llama 3.1's rope scaling in every stage and in the Megatron layers; Qwen2's q/k/v biases
sharded with their columns; no q/k norms in the tensor-parallel plans.

`PAIRS` is every family x every registered strategy with LoRA (the mixture of experts under each
strategy that takes one, fsdp+ep's expert parallelism only there), on the fewest ranks each layout
runs on (2; 4 where two dimensions must each be 2). `METHOD_PAIRS` adds full finetuning (every weight trains:
the untied head, the biases; compared by loss, gradient norm and the evaluation loss after the
step's update) and QLoRA (NF4 base weights resharded by DCP) where the family's difference meets
the method. The runs of each world size train one after another in one launch (`tests.batched`);
each pair is still a test of its own, failing by its name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distft.layout import SPECS
from distft.model import PRESETS
from distft.model.families import FAMILIES
from distft.parallel.registry import STRATEGIES
from tests.batched import run_cases
from tests.helpers import PARITY, assert_same_training, crashed_copy, distft, metrics

# The parity preset of each family.
FAMILY_PRESETS = {
    "qwen3": "micro",
    "llama": "llama-micro",
    "qwen2": "qwen2-micro",
    "mistral": "mistral-micro",
    "qwen3_moe": "qwen3-moe-micro",
}
# Adam's eps above the rounding of a gradient element of the experts (tests/parallel/test_moe.py).
FAMILY_SETTINGS = {"qwen3-moe-micro": ["optim.eps=1e-6"]}
# The 2-D and 3-D layouts on the fewest ranks that are not a 1-D strategy (4 where both
# dimensions must be 2; fsdp+tp runs on one FSDP rank, as test_fsdp_pp's 3D case does, and fsdp+cp's
# FSDP spans its 2 context-parallel ranks).
LAYOUTS = {
    "hsdp": ["parallel.shard=2"],
    "fsdp+tp": ["parallel.dp=1", "parallel.tp=2"],
    "ddp+pp": ["parallel.dp=2", "parallel.pp=2"],
    "fsdp+pp": ["parallel.dp=2", "parallel.pp=2"],
    "fsdp+tp+pp": ["parallel.dp=1", "parallel.tp=2", "parallel.pp=2"],
    "fsdp+cp": ["parallel.dp=1", "parallel.cp=2"],
    "hsdp+tp": ["parallel.tp=2", "parallel.shard=1"],  # 2 replicas of a TP group of 2
}
NPROC = {
    name: 2 if name in ("fsdp+tp", "fsdp+cp") or name not in LAYOUTS else 4
    for name in STRATEGIES
    if name != "single"
}
# PARITY's batch (global 4 = micro 1 x accumulation x ranks), over 2 steps of shorter rows; no
# base weights written and no validation: the adapters are compared as tensors.
_SET_HERE = ("--model", "micro", "train.max_steps", "data.max_length", "train.eval_batches")
SETTINGS = [
    *(a for a in PARITY if a.split("=")[0] not in _SET_HERE),
    "train.max_steps=2",
    "data.max_length=256",
    "train.eval_batches=0",
    "output.save_base=false",
]


PAIRS = [
    (FAMILY_PRESETS[f], s)
    for f in FAMILY_PRESETS
    for s in STRATEGIES
    # fsdp+ep's experts need a mixture of experts; a mixture of experts, a strategy that takes one
    if s != "single" and (SPECS[s].runs("moe") if FAMILIES[f].moe else not SPECS[s].expert_groups)
]
# (preset, method, strategy): each family's trained head or biases, and its NF4 base, where a
# strategy shards them its own way.
METHOD_PAIRS = [
    ("llama-micro", "full", "fsdp"),  # the untied head in FSDP's root unit, trained
    ("llama-micro", "full", "pp"),  # the untied head on the last stage, the embedding on the first
    ("qwen2-micro", "full", "tp-sp"),  # q/k/v biases trained, split with their Megatron columns
    ("mistral-micro", "full", "tp"),  # the untied head's vocabulary split by the DTensor plan
    ("llama-micro", "qlora", "fsdp"),  # NF4 projections (no q/k norms) sharded by fully_shard
    ("qwen2-micro", "qlora", "fsdp+pp"),  # NF4 beside fp32 biases, per stage and FSDP unit
]


def test_every_family_and_strategy_has_parity_coverage():
    """A new family (or strategy) fails here until it has a preset in this file's parity runs."""
    assert set(FAMILY_PRESETS) == set(FAMILIES)
    assert all(PRESETS[name].family == family for family, name in FAMILY_PRESETS.items())
    assert set(NPROC) == set(STRATEGIES) - {"single"}
    for family, name in FAMILY_PRESETS.items():
        takes = {
            s for s in NPROC if (SPECS[s].runs("moe") if FAMILIES[family].moe else not SPECS[s].expert_groups)
        }
        assert {s for m, s in PAIRS if m == name} == takes, name
        # Full finetuning and QLoRA of Qwen3 and its experts: each strategy's own file, test_moe.py.
        if family not in ("qwen3", "qwen3_moe"):
            assert "full" in {method for m, method, _ in METHOD_PAIRS if m == name}, name


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The single-process run of each family and method (2 steps, a checkpoint after step 1),
    trained on first use."""
    runs = {}

    def reference(model: str, method: str = "lora"):
        if (model, method) not in runs:
            runs[model, method] = tmp_path_factory.mktemp(f"{model}-{method}-single")
            distft("train", "--model", model, "--method", method, *SETTINGS, *METHOD_SETTINGS[method], *FAMILY_SETTINGS.get(model, []),
                   "--checkpoint-every", "1", "--out", str(runs[model, method]))  # fmt: skip
        return runs[model, method]

    return reference


# Full finetuning is compared by its validation loss after the last update (no adapter).
METHOD_SETTINGS = {"lora": [], "full": ["train.eval_batches=1"], "qlora": ["model.quant_scaler_block_size=4"]}


def resume_step_2(reference: Path, out: Path, strategy: str, *overrides: str) -> list[dict]:
    """The run as a crash during step 2 leaves it (step 1's checkpoint and record, no adapter),
    resumed under `strategy` (and `overrides`) by a launch of its own; its step records."""
    crashed_copy(reference, out, 1)
    proc = distft("train", *resume_args(out, strategy, *overrides))
    return resumed_records(out, proc.stdout)


def resume_args(out: Path, strategy: str, *overrides: str) -> list[str]:
    layout = ["--strategy", strategy, "--nproc", str(NPROC[strategy]), *LAYOUTS.get(strategy, [])]
    return ["--resume", str(out), *layout, *overrides]


def resumed_records(out: Path, stdout: str) -> list[dict]:
    """The resumed run's step records, once its output said where it resumed and every rank
    counted the bytes its formula and the planner predicted."""
    assert "resuming from" in stdout and "(step 1)" in stdout
    records = metrics(out)
    assert unrouted(records[1]["comm_bytes"]) == unrouted(records[1]["comm_bytes_expected"])
    # Every row fills data.max_length, so the plan's shapes are the run's: the planner's bytes
    # (`distft plan`'s formula, recorded at launch) equal what each rank counted, kind by kind.
    ranks = [rank["comm_bytes_per_step"] for rank in json.loads((out / "ranks.json").read_text())]
    for comm in ranks:
        assert unrouted(comm["predicted"]) == unrouted(comm["counted"]), comm
    # fsdp+ep's all-to-alls: a rank sends the rows its experts took, which the routing decides; the
    # plan is their mean, so their sum over the ranks is exact.
    assert sum(c["predicted"].get("all_to_all", 0) for c in ranks) == sum(
        c["counted"].get("all_to_all", 0) for c in ranks
    )
    return records


def unrouted(comm: dict[str, int]) -> dict[str, int]:
    return {kind: moved for kind, moved in comm.items() if kind != "all_to_all"}


CASES = [(model, "lora", strategy) for model, strategy in PAIRS] + METHOD_PAIRS


@pytest.fixture(scope="module")
def resumed(references, tmp_path_factory):
    """Every case resumed (`resume_step_2`), the cases of each world size in one launch: the step
    records of case (model, method, strategy), and a failure's tracebacks in place of them."""
    root = tmp_path_factory.mktemp("families")
    runs = {case: root / " ".join(case) for case in CASES}
    for case, run in runs.items():
        crashed_copy(references(case[0], case[1]), run, 1)
    results = {}
    for world in sorted({NPROC[strategy] for *_, strategy in CASES}):
        # No checkpoint of step 2 (a fifth of a case's time): the resume under test is step 1's.
        cases = {
            " ".join(c): resume_args(runs[c], c[2], "output.checkpoint_every=0")
            for c in CASES
            if NPROC[c[2]] == world
        }
        batch = run_cases(cases, world, root / f"logs-{world}")
        for case in CASES:
            name = " ".join(case)
            if name in cases:
                failed = batch.failure(name)
                results[case] = failed if failed else resumed_records(runs[case], batch.output(name))
    return lambda case: (runs[case], results[case])


def records_of(resumed, case: tuple[str, str, str]) -> tuple[Path, list[dict]]:
    run, records = resumed(case)
    if isinstance(records, str):
        pytest.fail(f"{case} failed in its launch:\n{records}")
    return run, records


@pytest.mark.parametrize(("model", "strategy"), PAIRS)
def test_resumes_and_trains_like_one_process(model, strategy, references, resumed):
    run, records = records_of(resumed, (model, "lora", strategy))
    assert_same_training(run, references(model))
    assert not any("eval_loss" in r for r in records)  # train.eval_batches=0: no validation


@pytest.mark.parametrize(("model", "method", "strategy"), METHOD_PAIRS)
def test_full_finetuning_and_qlora_train_like_one_process(model, method, strategy, references, resumed):
    run, got = records_of(resumed, (model, method, strategy))
    reference = references(model, method)
    if method == "qlora":
        assert_same_training(run, reference)
        return
    # Full finetuning exports no adapter: step 2's loss and gradient norm, and the evaluation after
    # its update, stand for every weight.
    for key in ("loss", "grad_norm", "eval_loss"):
        assert got[1][key] == pytest.approx(metrics(reference)[1][key], rel=1e-5), key
