"""DPO, ORPO and KTO under every kind of strategy (data parallel, sharded, tensor parallel, a
sequence split, a pipeline, and the 2-D and 3-D meshes): each trains as one process does on the
same global batch of pairs (KTO: of labelled answers), in losses, gradient norms, rewards and the
adapter, with the bytes its formula predicts; a reference that cannot be had is refused before
launch, in one line."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from distft.cli import main
from distft.config import load_config
from distft.io.lineage import base_stages, read_lineage, run_lineage
from distft.model.build import base_recipe
from tests.batched import run_cases
from tests.helpers import adapter, assert_same_training, crashed_copy, metrics, write_jsonl

NAMES, DAYS = ["Anna", "Bob", "Chen", "Dana", "Eli", "Fay"], ["Monday", "Friday", "next week"]
PAIR_STATS = ("rewards_chosen", "rewards_rejected", "accuracy", "margin", "logps_chosen", "logps_rejected")
KTO_STATS = ("rewards_chosen", "rewards_rejected", "margin", "logps_chosen", "logps_rejected", "kl")


def pair_rows() -> list[dict]:
    """Who owns an action item, and a rejected answer that swaps the owner (32 rows)."""
    rows = []
    for i in range(32):
        owner, other = random.Random(i).sample(NAMES, 2)
        day = random.Random(100 + i).choice(DAYS)
        prompt = (
            f"Meeting {i}: {owner} drafts the budget by {day}; {other} reviews it. Who drafts it, and when?"
        )
        rows.append({"prompt": prompt, "chosen": f"{owner}, by {day}.", "rejected": f"{other}, by {day}."})
    return rows


def unpaired_rows() -> list[dict]:
    """The pairs as KTO's rows: two in three answers desirable, the rest the rejected answer."""
    return [
        {"prompt": r["prompt"], "completion": r["chosen" if i % 3 else "rejected"], "label": bool(i % 3)}
        for i, r in enumerate(pair_rows())
    ]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return str(write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", pair_rows()))


@pytest.fixture(scope="module")
def unpaired(tmp_path_factory):
    return str(write_jsonl(tmp_path_factory.mktemp("unpaired") / "unpaired.jsonl", unpaired_rows()))


def settings(data: str, objective: str) -> list[str]:
    return [
        "--model", "micro", "--data", data, "--objective", objective, "train.max_steps=2",
        "train.global_batch_size=4", "train.micro_batch_size=1", "data.max_length=128",
        "optim.warmup_steps=1", "optim.lr=1e-3", "train.eval_every=0", "train.eval_batches=1",
    ]  # fmt: skip


def assert_same_pairs(run, reference, rtol: float = 1e-5, names=PAIR_STATS, atol: float = 1e-6) -> None:
    """The pair statistics of every step equal the reference's (rewards, margin, accuracy, log-probs;
    KTO's KL estimate). KTO's margin is a difference of two means of ratios of log-probabilities
    near -80, so its absolute tolerance is 1e-5."""
    for got, want in zip(metrics(run), metrics(reference), strict=True):
        for name in names:
            if want[name] is None:  # KTO: no answer of that label in the global batch
                assert got[name] is None, (got["step"], name)
            else:
                assert got[name] == pytest.approx(want[name], rel=rtol, abs=atol), (got["step"], name)


LAYOUTS = {  # 2 ranks unless said; fsdp+tp: a 2-D mesh with one FSDP shard
    "fsdp+tp": ["--nproc", "2", "parallel.dp=1", "parallel.tp=2"],
    "ddp+pp": ["--nproc", "4", "parallel.dp=2", "parallel.pp=2"],  # two pipelines of two stages
    "fsdp+pp": ["--nproc", "4", "parallel.dp=2", "parallel.pp=2"],
    "fsdp+tp+pp": ["--nproc", "4", "parallel.dp=1", "parallel.tp=2", "parallel.pp=2"],
}
# fsdp+tp's tensor-parallel reductions sum in another order: losses and gradient norms agree to
# 1e-6, but DPO weights each token's gradient by its pair's sigmoid and Adam divides near-zero
# gradients by their own magnitude, so after 2 steps one lora_B tensor differs by 1.4e-3 of its norm.
# tp-sp and cp likewise sum each answer's log-probability over sequence shards: 4.0e-3 of one lora_B
# (tp-sp; cp 1.1e-3).
ADAPTER_RTOL = {"fsdp+tp": 1e-2, "fsdp+tp+pp": 1e-2, "tp-sp": 1e-2, "cp": 1e-2}
# KTO likewise: every answer's gradient is weighted by a sigmoid of its ratio less z0, a sum over the
# whole global batch in another order on each layout; after 2 steps one lora_B differs by 1.6e-4.
KTO_ADAPTER_RTOL = 1e-3


def assert_same_steps(run, reference, rtol: float) -> None:
    for got, want in zip(metrics(run), metrics(reference), strict=True):
        for name in ("loss", "grad_norm"):
            assert got[name] == pytest.approx(want[name], rel=rtol), (got["step"], name)


# The strategies each objective trains under, here (DDP trains DPO as one process in the
# full-finetuning test below). A strategy may come with settings of its own: under ZeRO-2 a
# reference scored before step 1 leaves no layer gathered.
CASES = [
    *(("dpo", s) for s in ("fsdp+tp", "tp-sp", "cp", "ddp+pp", "zero2 dpo.precompute_reference=true")),
    *(("orpo", s) for s in ("pp", "fsdp+tp+pp")),
    *(("kto", s) for s in ("fsdp", "tp", "tp-sp", "pp", "fsdp+pp")),
]


FULL = ["--method", "full"]  # DPO's reference under full finetuning: precomputed (derived)


def layout(entry: str) -> list[str]:
    strategy, *own = entry.split()
    return ["--strategy", strategy, *LAYOUTS.get(strategy, ["--nproc", "2"]), *own]


@pytest.fixture(scope="module")
def runs(pairs, unpaired, tmp_path_factory):
    """Each objective's single-process reference (in this process), then every case (and DPO's
    full finetuning under DDP), those of each world size one after another in one launch
    (`tests.batched`): each run's folder, and each case's failure (None: it trained), by name."""
    root = tmp_path_factory.mktemp("objectives")
    data = {"dpo": pairs, "orpo": pairs, "kto": unpaired}
    folders = {objective: root / objective for objective in data}
    for objective, reference in folders.items():
        assert main(["train", *settings(data[objective], objective), "--out", str(reference)]) == 0
    args = {
        f"{objective} {entry}": [*settings(data[objective], objective), *layout(entry)]
        for objective, entry in CASES
    }
    # Full finetuning's DDP run, for the precomputed reference's test below.
    args["dpo full ddp"] = [*settings(pairs, "dpo"), *FULL, "--strategy", "ddp", "--nproc", "2"]
    for world in ("2", "4"):
        cases = {
            name: [*given, "--out", str(root / name.replace(" ", "_"))]
            for name, given in args.items()
            if given[given.index("--nproc") + 1] == world
        }
        batch = run_cases(cases, int(world), root / f"logs-{world}")
        for name, given in cases.items():
            folders[name] = Path(given[-1])
            folders[f"{name} failure"] = batch.failure(name)
    return folders


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_the_single_process_reference(objective, runs, pairs, unpaired, tmp_path):
    """At the reference the objective's first step is known in closed form; a reference scored
    before step 1 (KTO) and padded rows (DPO) train the same."""
    reference = runs[objective]
    first = metrics(reference)[0]
    if objective == "kto":  # at the reference: z0 = 0, every answer's loss 1 - sigmoid(0)
        assert first["loss"] == 0.5 and first["kl"] == 0.0
        assert all(m["kl"] >= 0 for m in metrics(reference)) and metrics(reference)[-1]["kl"] > 0
        # Scored before the first step, the reference (and so z0) is the same as the disabled adapters'.
        kept = tmp_path / "kept"
        assert (
            main(
                ["train", *settings(unpaired, objective), "dpo.precompute_reference=true", "--out", str(kept)]
            )
            == 0
        )
        assert_same_training(kept, reference)
        assert_same_pairs(kept, reference, names=KTO_STATS, atol=1e-5)
    if objective == "dpo":  # the policy starts as its reference: every margin 0, the loss log 2
        assert first["loss"] == pytest.approx(math.log(2), rel=1e-6)
        assert first["margin"] == first["rewards_chosen"] == 0.0 and first["accuracy"] == 0.0
        # Packed (the default: a micro-batch's answers as documents of one row, each attending to
        # itself only) or padded, the same training.
        padded = tmp_path / "padded"
        assert main(["train", *settings(pairs, objective), "data.packing=false", "--out", str(padded)]) == 0
        assert_same_training(padded, reference)
        assert_same_pairs(padded, reference)


@pytest.mark.parametrize(("objective", "entry"), CASES)
def test_trains_like_one_process(objective, entry, runs):
    name = f"{objective} {entry}"
    if failed := runs[f"{name} failure"]:
        pytest.fail(f"{name} failed in its launch:\n{failed}")
    run, reference, strategy = runs[name], runs[objective], entry.split()[0]
    stats = KTO_STATS if objective == "kto" else PAIR_STATS
    loose = ADAPTER_RTOL.get(strategy, KTO_ADAPTER_RTOL if objective == "kto" else None)
    if loose:  # steps as above; the adapter norm-wise, looser
        assert_same_steps(run, reference, rtol=1e-5)
        a, b = adapter(run), adapter(reference)
        assert all((a[k] - b[k]).norm() <= loose * b[k].norm() for k in b), strategy
    else:
        assert_same_training(run, reference)
    # Rewards are differences of log-probabilities near -80: a sum over shards in another order moves them by 1e-6.
    loose_pairs = objective == "kto" or strategy in ("tp-sp", "cp")
    assert_same_pairs(run, reference, names=stats, atol=1e-5 if loose_pairs else 1e-6)
    # The bytes of both rows of every pair (KTO: and of its KL term's forwards), counted as any run's are, match the formula.
    counted = [m for m in metrics(run) if "comm_bytes_expected" in m]
    assert counted and all(m["comm_bytes"] == m["comm_bytes_expected"] for m in counted), strategy


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (
            ["--strategy", "pp", "--nproc", "2", "dpo.precompute_reference=false"],
            "no pipeline stage can run the base under disabled adapters",
        ),
        (["--method", "full", "dpo.precompute_reference=false"], "set dpo.precompute_reference=true"),
    ],
    ids=["pp", "full"],
)
def test_what_cannot_run_is_refused_before_launch(flags, says, pairs, tmp_path, capsys):
    assert main(["train", *settings(pairs, "dpo"), *flags, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()


def test_a_precomputed_reference_trains_as_the_disabled_adapters_do_and_full_finetuning_uses_it(
    runs, pairs, tmp_path, capsys
):
    """dpo.precompute_reference scores every pair once, before the first step, with the model as
    it starts: under LoRA the same reference the disabled adapters give in every step, so the same
    training; from a trained adapter (lora.init_adapter, derived there) the base with it; under
    --method full (derived there) two DDP ranks train as one process, and a run cut after step 1
    resumes from the scores the run directory kept, not from the trained model."""
    live, kept = runs["dpo"], tmp_path / "kept"  # live: the module's DPO reference, these settings
    assert main(["train", *settings(pairs, "dpo"), "dpo.precompute_reference=true", "--out", str(kept)]) == 0
    assert (kept / "reference_logps.safetensors").is_file() and not (
        live / "reference_logps.safetensors"
    ).exists()
    assert_same_training(kept, live)
    assert_same_pairs(kept, live)
    # From the SFT adapter trained on the chosen answers: the reference is the base with it.
    sft, start = tmp_path / "sft", tmp_path / "start"
    assert main(["train", *settings(pairs, "sft"), "--out", str(sft)]) == 0
    assert main(["train", *settings(pairs, "dpo"), f"lora.init_adapter={sft}", "--out", str(start)]) == 0
    first = metrics(start)[0]
    assert first["loss"] == pytest.approx(math.log(2), rel=1e-6) and first["margin"] == 0.0
    assert (start / "reference_logps.safetensors").is_file()  # derived: scored before it trains
    assert first["logps_chosen"] > metrics(live)[0]["logps_chosen"]  # it learnt the chosen answers
    # Its lineage goes on from the SFT run's: random micro, then the SFT adapter, then this run.
    stages = read_lineage(start)["stages"]
    assert [(s["method"], s["run"]) for s in stages] == [
        ("lora", str(sft.resolve())),
        ("lora", str(start.resolve())),
    ]
    assert stages[-1]["continues"] and base_stages(read_lineage(start)) == []  # the base: micro itself
    # The same adapter on another base (micro drawn with another seed) starts a chain of its own.
    other = load_config(None, ["model.name=micro", "model.seed=1", f"lora.init_adapter={sft}"])
    assert [s.get("continues") for s in run_lineage(other, base_recipe(other.model))["stages"]] == [None]
    capsys.readouterr()
    for flags, says in [
        (["lora.rank=8"], "was trained with r=16, this run asks lora.rank = 8"),
        (["dpo.precompute_reference=false"], "set dpo.precompute_reference=true"),
    ]:
        refused = ["train", *settings(pairs, "dpo"), f"lora.init_adapter={sft}", "--out", str(tmp_path / "x")]
        assert main([*refused, *flags]) == 2 and not (tmp_path / "x").exists()
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
    # distft eval on a preference run: how often each model finds the chosen answer more likely,
    # the adapter it started from beside the base and the result.
    scores = tmp_path / "eval.json"
    assert (
        main(["eval", "--run", str(start), "--rows", "4", "--max-new-tokens", "4", "--output", str(scores)])
        == 0
    )
    models = json.loads(scores.read_text())["models"]
    assert list(models) == ["base", "start", "finetuned"]
    for s in models.values():
        assert 0 <= s["preference_accuracy"] <= 1 and s["rougeL"] is not None  # against the chosen answer
    assert models["start"]["loss"] < models["base"]["loss"]  # the SFT adapter, not the base again
    assert models["finetuned"]["preference_margin"] > models["start"]["preference_margin"]

    single, ddp = tmp_path / "full", runs["dpo full ddp"]  # ddp: 2 ranks, in the module's launch
    checkpointed = [*settings(pairs, "dpo"), *FULL, "output.checkpoint_every=1"]  # for the cut below
    assert main(["train", *checkpointed, "--out", str(single)]) == 0
    assert metrics(single)[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)  # the reference is the start
    if failed := runs["dpo full ddp failure"]:
        pytest.fail(f"full finetuning under DDP failed in its launch:\n{failed}")
    for got, want in zip(metrics(ddp), metrics(single), strict=True):  # full finetuning: no adapter
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5) and got["grad_norm"] == pytest.approx(
            want["grad_norm"], rel=1e-5
        )
    assert_same_pairs(ddp, single)
    cut = crashed_copy(single, tmp_path / "cut", after_step=1)
    assert main(["train", "--resume", str(cut)]) == 0
    assert [m["loss"] for m in metrics(cut)] == [m["loss"] for m in metrics(single)]
