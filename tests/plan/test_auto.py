"""The planner on a training config (`distft.plan.auto`): `--strategy auto` resolves to a strategy
the runtime runs and says why; `--dry-run` checks, prints the batch and the plan's estimate, and
writes nothing; a run records the prediction beside what it measured (memory, bytes and, in every
step record, the step time: null on the CPU, which has no bf16 peak; one real 2-process launch)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import distft.plan.auto as auto
from distft.cli import build_parser, config_from_args, main
from distft.parallel import STRATEGIES, check_config
from distft.plan import predict
from distft.plan.explain import Recommendation
from distft.plan.inputs import Parallelism
from tests.helpers import distft, metrics

SHORT = [
    "train.max_steps=1", "train.eval_every=0", "train.eval_batches=1", "data.max_length=256",
    "data.max_rows=16", "output.save_base=false",
]  # fmt: skip


def test_auto_resolves_to_a_runnable_strategy_and_says_why(capsys):
    cfg = config_from_args(
        build_parser().parse_args(["train", "--strategy", "auto", "--nproc", "2", "--model", "micro"])
    )
    assert cfg.parallel.strategy in STRATEGIES and cfg.world_size == 2
    check_config(cfg)
    out = capsys.readouterr().out
    # micro fits one process's share of the host with room to spare: DDP for throughput, and why.
    assert cfg.parallel.strategy == "ddp"
    assert "strategy auto: DDP on 2 processes (CPU: " in out and "memory is not the problem" in out
    # in a CPU run's words: its processes all-reduce over gloo, not over a GPU's PCIe link
    assert "gradients per step over gloo between the processes of one host" in out
    assert "PCIe" not in out and "GPU" not in out
    assert cfg.derived["parallel.strategy"].startswith("ddp: the planner's choice")


def test_auto_runs_the_expert_groups_it_planned(monkeypatch):
    """Where the plan picks fsdp+ep in groups smaller than the world (a node's GPUs, on several
    nodes), `--strategy auto` runs those groups, their experts replicated or sharded across them
    as planned, and the prediction is for them."""

    argv = ["train", "--strategy", "auto", "--nproc", "4", "--model", "qwen3-moe-micro"]
    for sharded in (False, True):
        planned = Parallelism.at("fsdp+ep", dp=4, ep=2, shard_experts=sharded)
        picked = Recommendation("fsdp+ep", "lora", "none", "planned", [], parallelism=planned)
        monkeypatch.setattr(auto, "decide", lambda request, picked=picked: picked)
        cfg = config_from_args(build_parser().parse_args(argv))
        assert (cfg.parallel.strategy, cfg.parallel.ep, cfg.parallel.shard_experts) == ("fsdp+ep", 2, sharded)
        check_config(cfg)
        assert auto.parallelism_of(cfg, "1f1b") == replace(planned, microbatches=1)


def test_prediction_is_the_layout_the_runtime_builds():
    argv = ["train", "--model", "micro", "--strategy", "fsdp+pp", "--nproc", "4"]
    cfg = config_from_args(build_parser().parse_args(argv))
    p = predict(cfg)
    assert p["layout"] == "FSDP x PP (dp=2, pp=2) on 4 processes"
    assert p["peak_mem_bytes"] == sum(p["by_component"].values()) > 0
    assert p["comm_bytes"]["send"] > 0  # the pipeline's activations cross stages
    # On the CPU there is no bf16 peak: no step time, and why.
    assert p["step_time"] is None and p["step_time_note"] == "no bf16 peak for cpu"


def test_dry_run_checks_and_estimates_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--strategy", "hsdp", "--nproc", "4", "--model", "micro", "--out", str(out), "--dry-run"]
    assert main([*argv, *SHORT]) == 0
    text = capsys.readouterr().out
    assert "dry run: every check before launch passed; nothing trained, nothing written" in text
    assert "derived (not set): parallel.shard=2" in text
    assert "global batch 8 = micro-batch 2 x accumulation 1 x data-parallel ranks 4" in text
    assert (
        "plan for HSDP (shard=2, replicas=2) on 4 processes (CPU: " in text
        and "per process at the fullest" in text
    )
    assert not out.exists()
    # A check that fails still fails the dry run, with its one paragraph.
    assert main([*argv, *SHORT, "parallel.shard=4"]) == 2
    capsys.readouterr()
    # A preference run counts pairs, each two sequences (the bundled pairs hold out 120 of their own).
    pairs = ["train", "--model", "micro", "--data", "sample-pairs", "train.objective=dpo", "--dry-run"]
    assert main([*pairs, "--out", str(out), *SHORT, "data.max_length=192"]) == 0
    text = capsys.readouterr().out
    assert "tokenised 16 training pairs and 120 validation pairs in " in text
    assert "global batch 8 pairs = micro-batch 4 x accumulation 2 x data-parallel ranks 1;" in text
    assert "192 tokens per sequence, 2 sequences a pair;" in text


def test_auto_run_records_predicted_beside_measured(tmp_path):
    out = tmp_path / "auto"
    proc = distft(
        "train", "--strategy", "auto", "--nproc", "2", "--model", "micro", "--out", str(out), *SHORT
    )
    assert "strategy auto: DDP on 2 processes" in proc.stdout
    assert (
        "peak memory per process: predicted" in proc.stdout and "measured: unavailable on CPU" in proc.stdout
    )
    assert "collectives per process, step 1: predicted" in proc.stdout
    assert "step time: predicted n/a (no bf16 peak for cpu), measured" in proc.stdout
    for record in metrics(out):  # every step: the measured time, and the prediction (none on CPU)
        assert record["step_time_s"] > 0 and record["step_time_predicted_s"] is None
    ranks = json.loads((out / "ranks.json").read_text())
    for r in ranks:
        assert r["memory"]["predicted_peak_bytes"] > 0 and r["memory"]["measured"] == "unavailable on CPU"
        comm = r["comm_bytes_per_step"]
        assert comm["predicted"] == comm["counted"] and comm["counted"]["all_reduce"] > 0
    assert (
        f"wrote {out}/: adapter/, base/, config.toml, lineage.json, metrics.jsonl, ranks.json" in proc.stdout
    )


# bf16 full finetuning on the multi-dimensional layouts, which tests/plan/test_counted.py does not
# build in-process and the family runs train in fp32 only: fp32 master weights' gradients and
# bf16 gathers across HSDP's replicas, bf16 stage boundaries with DDP or FSDP x TP around them.
# (Their LoRA and QLoRA bytes are checked on every rank by tests/parallel/test_families.py.)
MULTI_RANK = [
    ("hsdp", []),
    ("ddp+pp", ["parallel.pp=2"]),
    ("fsdp+tp+pp", ["parallel.tp=2", "parallel.pp=2"]),
]


@pytest.mark.parametrize(("strategy", "layout"), MULTI_RANK)
def test_every_rank_moves_the_bytes_the_planner_predicted(strategy, layout, tmp_path):
    """Rows that fill data.max_length make the plan's shapes the run's: each rank's counted bytes
    of step 1 equal its pipeline rank's prediction, kind by kind."""
    distft("train", "--model", "micro", "--strategy", strategy, "--method", "full", "--nproc", "4",
           *layout, "model.dtype=bfloat16", *SHORT, "train.eval_batches=0", "--out", str(tmp_path))  # fmt: skip
    for r in json.loads((tmp_path / "ranks.json").read_text()):
        comm = r["comm_bytes_per_step"]
        assert comm["predicted"] == comm["counted"], (r["rank"], comm)


def test_a_run_the_plan_says_cannot_fit_is_refused_before_launch_unless_forced(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(auto, "device_memory", lambda cfg: (8 << 30, "CPU: 8 GiB each"))
    out = tmp_path / "run"
    argv = ["train", "--model", "qwen3-4b", "--out", str(out), *SHORT]
    for launch in ([], ["--dry-run"]):  # the same refusal, dry run or not, and nothing written
        assert main([*argv, *launch]) == 2
        err = capsys.readouterr().err
        assert "the plan says this run does NOT fit: " in err and "in 7 GiB usable (CPU: 8 GiB each)" in err
        assert "The planner's choice for 1 process here: --strategy single --method qlora" in err
        assert "Add --force to launch it anyway." in err and "GPU" not in err  # a CPU run's words
        assert not out.exists()
    assert main([*argv, "--dry-run", "--force"]) == 0
    assert "does NOT fit: " in capsys.readouterr().err
    # More processes than CPU cores: valid (layouts are checked so), and said.
    monkeypatch.setattr("distft.train.preflight._cpu_cores", lambda: 2)
    assert main(["train", "--model", "micro", "--strategy", "ddp", "--nproc", "64", "--dry-run", *SHORT]) == 0
    assert "warning: --nproc 64 on 2 CPU cores: the processes take turns" in capsys.readouterr().err
    # A setup refused before launch says only why: no warning about the cores of a run that will not start.
    refused = [
        "train",
        "--model",
        "micro",
        "--strategy",
        "tp-sp",
        "--nproc",
        "64",
        "--dry-run",
        *SHORT,
    ]
    assert main(refused) == 2
    err = capsys.readouterr().err
    assert (
        "the TP degree must divide both" in err
        and "warning" not in err
        and len(err.strip().splitlines()) == 1
    ), err
    # --strategy auto on 2 processes where nothing fits as asked: the checkpointing the plan needs, by level.
    monkeypatch.setattr(auto, "device_memory", lambda cfg: (12 << 30, "CPU: 12 GiB each"))
    cfg = config_from_args(
        build_parser().parse_args(["train", "--strategy", "auto", "--nproc", "2", "--model", "qwen3-4b"])
    )
    assert (
        cfg.model.activation_checkpointing == "full"
        and "Activation checkpointing: full." in capsys.readouterr().out
    )
