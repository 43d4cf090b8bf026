"""The plan and the runtime agree: which strategies distft runs, and what its `run:` line sets.

A printed `run:` command is parsed back with `distft train`'s own argument parser and config loader
(`distft.cli.build_parser`, `config_from_args`: defaults, overrides, flags, validation) and compared
with what the estimate assumed: method, strategy, processes, dtype, micro-batch, global batch,
sequence length, activation checkpointing, attention, LoRA rank, mesh degrees and the pipeline,
which must be the very `Layout` the runtime's strategy builds from that config; and what a run
needs beyond the estimate: the pretrained weights, their learning rate and `--data`.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import replace

import pytest

from distft.cli import build_parser, config_from_args, main
from distft.layout import SPECS, ParallelDims
from distft.parallel import STRATEGIES, check_config
from distft.parallel.derive import PRETRAINED_FULL_LR, PRETRAINED_LORA_LR, RANDOM_PRESET_LR
from distft.plan import evaluate, make_request, run_command
from distft.plan.decide import decide
from distft.plan.estimate import estimate
from distft.plan.report import to_dict
from distft.plan.run_line import DATA_PLACEHOLDER


def request(command: str):
    return make_request(build_parser().parse_args(["plan", *command.split()]))


def parse_run(command: str):
    """The config `distft train` would run for a printed `run:` line."""
    argv = shlex.split(command)
    assert argv[:2] == ["distft", "train"]
    return config_from_args(build_parser().parse_args(argv[1:]))


def test_runnable_strategies_come_from_the_registry():
    req = request("--model qwen3-4b --method lora --gpus 8 --gpu h100")
    estimates = evaluate(req)
    # Every strategy distft runs is modelled, and every layout the planner models, distft runs.
    assert list(estimates) == list(STRATEGIES)
    for name, e in estimates.items():
        assert e.runnable and e.in_distft == "yes", name
    assert {"zero1", "hsdp", "pp", "fsdp+tp", "ddp+pp", "fsdp+pp", "fsdp+tp+pp"} <= {
        n for n, e in estimates.items() if e.runnable
    }


def test_qlora_runs_only_where_the_registry_says():
    req = request("--model qwen3-4b --method qlora --gpus 4 --gpu rtx4090")
    estimates = evaluate(req)
    for name, e in estimates.items():
        supported = SPECS[name].runs("qlora")
        assert e.runnable == supported, name


PLANS = [
    "--model qwen3-4b --method lora --gpus 8 --gpu h100 --seq-len 1024 --micro-batch 2 --grad-accum 3",
    "--model qwen3-1.7b --method full --gpus 4 --nodes 2 --gpu a100-80gb --activation-checkpointing "
    "--precision fp32 --attention eager --pp-schedule gpipe --pp-microbatches 8",
    "--model qwen3-0.6b --method lora --gpus 4 --gpu rtx4090 --lora-rank 8 --pp-schedule interleaved-1f1b",
]


@pytest.mark.parametrize("command", PLANS)
def test_every_run_line_carries_the_estimates_assumptions(command):
    req = request(command)
    t = req.training
    for name, e in evaluate(req).items():
        line = run_command(req, name, t.method, t.activation_checkpointing, e.parallelism)
        if not e.runnable:
            assert line is None
            continue
        if not e.applicable:
            continue
        cfg = parse_run(line)
        lay = e.parallelism
        assert (cfg.parallel.strategy, cfg.train.method) == (name, t.method)
        assert cfg.world_size == (1 if name == "single" else req.world) == lay.world
        assert cfg.model.dtype == t.precision.dtype
        assert cfg.model.activation_checkpointing == t.activation_checkpointing
        assert cfg.model.attn_implementation == t.attention
        assert cfg.data.max_length == t.seq_len
        assert cfg.train.micro_batch_size == t.micro_batch
        assert cfg.train.global_batch_size == t.micro_batch * lay.microbatches * lay.dp
        assert cfg.lora.rank == t.lora_rank
        cls = STRATEGIES[name]
        assert cls.data_parallel_size(cfg) == lay.dp, name
        dims = ParallelDims.of(cls.spec, cfg)  # the runtime's degrees are the plan's, groups too
        assert dims == lay.dims, name
        if cls.spec.shard_groups:  # HSDP (x TP): the shard groups the plan counted, a node's data ranks
            assert dims.dp_shard == lay.shard_degree == req.gpus_per_node // lay.tp
        if lay.pp > 1:  # the runtime's own pipeline for this config is the one the plan counted
            assert cls.pipeline_layout(cfg) == lay.pipeline(t.micro_batch)
        # What a run needs beyond the estimate: the pretrained weights, their learning rate, data.
        assert cfg.model.name.startswith("Qwen/Qwen3-") and {"optim.lr", "data.source"} <= cfg.explicit
        assert cfg.optim.lr == (PRETRAINED_FULL_LR if t.method == "full" else PRETRAINED_LORA_LR)
        assert cfg.data.source == DATA_PLACEHOLDER != "sample"


def test_a_cpu_presets_run_line_trains_on_the_sample_at_the_presets_rate():
    req = request("--model tiny --method lora --gpus 2 --gpu-mem 8GiB --seq-len 768")
    rec = decide(req)
    cfg = parse_run(run_command(req, rec.strategy, rec.method, rec.activation_checkpointing, rec.parallelism))
    assert (cfg.model.name, cfg.data.source, cfg.optim.lr) == ("tiny", "sample", RANDOM_PRESET_LR)
    assert (cfg.parallel.strategy, cfg.parallel.nproc, cfg.data.max_length) == ("ddp", 2, 768)


@pytest.mark.parametrize(
    "command,strategy",
    [
        ("--model llama-2-13b --method full --gpus 8 --gpu a100-80gb --activation-checkpointing", "zero1"),
        (
            "--model qwen3-32b --method full --gpus 8 --nodes 4 --gpu h100 --interconnect infiniband "
            "--activation-checkpointing",
            "hsdp",
        ),
        ("--model qwen3-30b-a3b --method full --gpus 8 --gpu h100", "fsdp+ep"),  # a mixture of experts
    ],
)
def test_zero1_hsdp_and_ep_recommendations_pass_the_checks_before_launch(command, strategy):
    """What the planner recommends, distft runs: the printed line passes `distft train`'s checks
    (`config_from_args` runs the strategy's `check_config`) and cuts the batch as the plan did."""
    req = request(command)
    estimates = evaluate(req)
    rec = decide(req, estimates)
    assert rec.strategy == strategy, rec.reason
    cfg = parse_run(to_dict(req, estimates, rec)["recommendation"]["command"])
    assert (cfg.parallel.strategy, cfg.world_size, cfg.parallel.nnodes) == (strategy, req.world, req.nodes)
    shape = check_config(cfg)
    assert (
        shape.data_parallel_size == rec.parallelism.dp
        and shape.accumulation_steps == rec.parallelism.microbatches
    )
    if strategy == "hsdp":
        assert cfg.parallel.shard == 8 and STRATEGIES["hsdp"].nf4_shards(cfg) == 8


def test_recommended_command_in_json_matches_the_request():
    req = request(
        "--model Qwen/Qwen3-4B --method lora --gpus 2 --gpu-mem 24GiB --interconnect pcie --seq-len 1024"
    )
    estimates = evaluate(req)
    rec = decide(req, estimates)
    doc = to_dict(req, estimates, rec)
    cfg = parse_run(doc["recommendation"]["command"])
    assert cfg.parallel.strategy == rec.strategy == "ddp" and cfg.parallel.nproc == 2
    assert (cfg.model.dtype, cfg.train.micro_batch_size, cfg.data.max_length) == ("bfloat16", 1, 1024)
    # distft's defaults would be fp32, micro-batch 4 and 768 tokens: the line must override them.
    default = parse_run("distft train --model Qwen/Qwen3-4B --strategy ddp --nproc 2")
    assert (default.model.dtype, default.train.micro_batch_size) != (
        cfg.model.dtype,
        cfg.train.micro_batch_size,
    )


def test_zero1_recommendation_prints_a_command_train_accepts():
    """An optimizer-bound full finetune: the plan's ZeRO-1 comes with a `run:` line the runtime takes."""
    req = request("--model qwen3-1.7b --method full --gpus 2 --gpu rtx4090 --activation-checkpointing")
    estimates = evaluate(req)
    rec = decide(req, estimates)
    assert rec.strategy == "zero1" and estimates["zero1"].runnable
    line = to_dict(req, estimates, rec)["recommendation"]["command"]
    assert "--strategy zero1" in line
    assert check_config(parse_run(line)).data_parallel_size == 2


def test_recommended_pipelines_print_a_command_train_accepts():
    """The 3D recommendation across nodes (and FSDP x PP, its alternative) parse back into configs
    the runtime's checks accept, with the mesh and pipeline the plan counted."""
    req = request(
        "--model llama-3-70b --method full --gpus 8 --nodes 4 --gpu h100 --interconnect infiniband "
        "--seq-len 4096 --activation-checkpointing"
    )
    estimates = evaluate(req)
    rec = decide(req, estimates)
    assert rec.strategy == "fsdp+tp+pp"
    for name in ("fsdp+tp+pp", "fsdp+pp"):
        lay = estimates[name].parallelism
        line = to_dict(req, estimates, rec)["recommendation"]["command"] if name == rec.strategy else None
        line = line or run_command(req, name, "full", "full", lay)
        cfg = parse_run(line)
        assert check_config(cfg).data_parallel_size == lay.dp  # the runtime's checks before launch
        assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp) == (lay.dp, lay.tp, lay.pp)
        assert STRATEGIES[name].pipeline_layout(cfg) == lay.pipeline(req.training.micro_batch)


def test_a_long_sequence_walks_to_the_checkpointing_level_that_fits_one_gpu():
    """Full checkpointing where the layer inputs fit beside one layer's recompute, offload where
    they do not; the run: line carries the level and the RoPE scaling the length needs."""
    for seq, rope, level in ((32768, "", "full"), (65536, " --rope-scaling yarn --rope-factor 2", "offload")):
        req = request(f"--model Qwen/Qwen3-4B --gpu rtx4090 --seq-len {seq}{rope}")
        rec = decide(req, evaluate(req))
        assert (rec.strategy, rec.activation_checkpointing) == ("single", level), rec.reason
        cfg = parse_run(
            run_command(req, rec.strategy, rec.method, rec.activation_checkpointing, rec.parallelism)
        )
        assert cfg.model.activation_checkpointing == level and cfg.data.max_length == seq
        assert cfg.model.rope_scaling == ("yarn" if rope else "none")
    # The same walk from a level already asked for: offload comes only after full.
    req = request(
        "--model Qwen/Qwen3-4B --gpu rtx4090 --seq-len 65536 --rope-scaling yarn --rope-factor 2 "
        "--activation-checkpointing"
    )
    assert decide(req, evaluate(req)).activation_checkpointing == "offload"


def test_a_sequence_too_long_for_one_gpu_even_offloaded_walks_to_context_parallelism():
    req = request(
        "--model Qwen/Qwen3-4B --gpus 4 --gpu rtx4090 --seq-len 131072 --rope-scaling yarn --rope-factor 4 "
        "--activation-checkpointing"
    )
    estimates = evaluate(req)
    rec = decide(req, estimates)
    # Context parallelism, with FSDP sharding the weights too: as fast as CP in less memory.
    assert rec.strategy == "fsdp+cp" and estimates["fsdp+cp"].total < estimates["cp"].total, rec.reason
    offloaded = evaluate(replace(req, training=replace(req.training, activation_checkpointing="offload")))
    assert not offloaded["single"].fits and estimates["cp"].fits  # not one GPU, even offloaded
    # It moves less than TP+SP, which splits the sequence too, and is faster for it.
    assert estimates["cp"].comm_bytes < estimates["tp-sp"].comm_bytes / 4
    cfg = parse_run(run_command(req, rec.strategy, rec.method, rec.activation_checkpointing, rec.parallelism))
    assert check_config(cfg).data_parallel_size == 1 and cfg.parallel.nproc == 4


def test_cp_method_ring_is_planned_and_its_run_lines_run_the_ring(capsys):
    """--cp-method ring: the cp layouts are estimated as `Parallelism(cp_method="ring")` is (other
    traffic than allgather's), the other layouts as before, and their run: lines run the ring."""
    argv = ["plan", "--model", "micro", "--gpu", "h100", "--gpus", "2", "--json"]
    docs = {}
    for method in ("allgather", "ring"):
        assert main([*argv, "--cp-method", method]) == 0
        docs[method] = {s["strategy"]: s for s in json.loads(capsys.readouterr().out)["strategies"]}
    req = request("--model micro --gpu h100 --gpus 2 --cp-method ring")
    assert req.cp_method == "ring"
    estimates = evaluate(req)
    for name in ("cp", "fsdp+cp"):
        ring, gathered = docs["ring"][name], docs["allgather"][name]
        assert (ring["layout"]["cp_method"], gathered["layout"]["cp_method"]) == ("ring", "allgather")
        assert ring["label"].endswith("ring)") and "ring" not in gathered["label"]
        wire = "wire_bytes_per_step"
        assert ring["communication"][wire] != gathered["communication"][wire], name
        lay = estimates[name].parallelism
        direct = estimate(replace(req, cp_method="allgather"), replace(lay, cp_method="ring"), name)
        assert ring["bytes_per_gpu"] == {**direct.components, "total": direct.total}, name
        assert ring["communication"][wire] == direct.comm_bytes, name
        cfg = parse_run(run_command(req, name, "lora", "none", lay))
        assert cfg.parallel.cp_method == "ring" and "parallel.cp_method" in cfg.explicit, name
    assert docs["ring"]["ddp"] == docs["allgather"]["ddp"]  # no cp: nothing changes
    assert "parallel.cp_method" not in run_command(req, "ddp", "lora", "none", estimates["ddp"].parallelism)
    # An unknown method is refused by the parser, before the planner runs.
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--model", "micro", "--gpu", "h100", "--cp-method", "spiral"])
