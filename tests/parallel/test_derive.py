"""Defaults that compose (`distft.parallel.derive`): `--strategy S --nproc N` alone passes every
check before launch for every strategy in the registry, on micro and tiny; what the user set is
never changed; the learning rate follows the base and the method. Pure: no process is launched."""

from __future__ import annotations

import pytest

from distft.cli import build_parser, config_from_args, main
from distft.config import load_config
from distft.errors import ConfigError
from distft.layout import SPECS
from distft.model import model_config
from distft.parallel import STRATEGIES, check_config, check_model
from distft.parallel.derive import PRETRAINED_FULL_LR, PRETRAINED_LORA_LR, RANDOM_PRESET_LR, derived_line

# Each strategy's smallest --nproc, and the next sizes up where what is derived differs.
SIZES = {
    "single": [1],
    "ddp": [1, 2, 3, 4],
    "zero1": [1, 2, 4],
    "fsdp": [1, 2, 4],
    "zero2": [1, 2, 4],
    "hsdp": [4, 6],
    "tp": [1, 2],
    "tp-sp": [1, 2],
    "cp": [1, 2, 4],
    "pp": [2, 3, 4],
    "fsdp+tp": [2, 4, 6],
    "ddp+pp": [4, 6, 8],
    "fsdp+pp": [4, 6],
    "fsdp+tp+pp": [4, 6, 8],
    "fsdp+cp": [2, 4],
    "fsdp+ep": [1, 2, 4, 8],  # on a mixture of experts (8 experts: a divisor of 8)
    "hsdp+tp": [4, 8],  # tp=2 and 2 replicas of shard groups of 1, then of 2
}


def parse(*argv: str):
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_every_strategy_runs_with_strategy_and_nproc_alone():
    assert set(SIZES) == set(STRATEGIES), "a new strategy: add its sizes here"
    lines = []
    for model in ("micro", "tiny", "qwen3-moe-micro"):
        architecture = model_config(model, False)
        for name, sizes in SIZES.items():
            if SPECS[name].expert_groups != (model == "qwen3-moe-micro"):  # the MoE: its own strategy
                continue
            for n in sizes:
                cfg = parse("--model", model, "--strategy", name, "--nproc", str(n))
                shape = check_config(cfg)
                check_model(cfg, architecture)
                assert cfg.world_size == n and cfg.parallel.strategy == name
                per_step = shape.micro_batch_size * shape.accumulation_steps * shape.data_parallel_size
                assert per_step == cfg.train.global_batch_size, (model, name, n)
                lines.append(derived_line(cfg) or "")
    # One line says what was derived and why, e.g.:
    shard = "derived (not set): parallel.shard=2: 4 processes on one node as 2 replicas of 2 shards"
    assert any(x.startswith(shard) for x in lines)
    assert any(
        "parallel.microbatches=2: 1f1b over 2 pipeline ranks needs 2+ micro-batches" in x for x in lines
    )


def test_what_was_derived_is_said_once_by_a_dry_run(tmp_path, capsys):
    """The launching command leaves it to the dry run's summary (a run's header, when it trains)."""
    argv = ["train", "--model", "qwen3-moe-micro", "--strategy", "fsdp+ep", "--nproc", "4", "--dry-run"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("derived (not set): train.micro_batch_size=2: the global batch of 8 split over 4") == 1


def test_derivations_keep_the_global_batch_where_it_splits():
    cfg = parse("--model", "micro", "--strategy", "hsdp", "--nproc", "4")
    assert (cfg.parallel.shard, cfg.train.global_batch_size, cfg.train.micro_batch_size) == (2, 8, 2)
    assert set(cfg.derived) == {"optim.lr", "optim.warmup_ratio", "parallel.shard", "train.micro_batch_size"}
    cfg = parse("--model", "micro", "--strategy", "ddp", "--nproc", "3")  # 8 does not split 3 ways
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size) == (12, 4)
    cfg = parse("--model", "micro", "--strategy", "fsdp+pp", "--nproc", "4")
    assert (cfg.parallel.pp, cfg.parallel.microbatches, cfg.train.global_batch_size) == (2, 2, 8)
    cfg = parse("--model", "micro", "--strategy", "ddp", "--nproc", "4", "train.micro_batch_size=4")
    assert cfg.train.global_batch_size == 16  # the micro-batch was set: the global batch follows it
    cfg = parse("--model", "micro", "--strategy", "ddp", "--nproc", "2")  # passes as it is
    assert set(cfg.derived) == {"optim.lr", "optim.warmup_ratio"} and cfg.train.micro_batch_size == 4


@pytest.mark.parametrize(
    "argv,phrase",
    [
        (
            ["--strategy", "ddp", "--nproc", "4", "train.micro_batch_size=4", "train.global_batch_size=8"],
            "multiple",
        ),
        (["--strategy", "ddp", "--nproc", "3", "train.global_batch_size=8"], "must be a multiple of"),
        (["--strategy", "hsdp", "--nproc", "4", "parallel.shard=4"], "it is plain FSDP"),
        (["--strategy", "fsdp+pp", "--nproc", "4", "parallel.pp=1"], "use --strategy fsdp,"),
        (["--strategy", "pp", "--nproc", "4", "parallel.microbatches=2"], "at least as many micro-batches"),
    ],
)
def test_what_the_user_set_keeps_its_error(argv, phrase):
    with pytest.raises(ConfigError, match=phrase):
        parse("--model", "micro", *argv)


def test_explicit_fields_are_tracked_from_file_overrides_and_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nglobal_batch_size = 16\n")
    cfg = load_config(path, ["optim.lr=1e-3", "parallel.nproc=2"])
    assert cfg.explicit == {"train.global_batch_size", "optim.lr", "parallel.nproc"}
    assert load_config().explicit == frozenset()


def test_learning_rate_follows_the_base_and_the_method(tmp_path):
    assert parse("--model", "tiny").optim.lr == RANDOM_PRESET_LR  # presets: as before
    # a preset's rate is the schema's default: only the header says it
    assert "optim.lr" not in (derived_line(parse("--model", "tiny")) or "")
    assert parse("--model", "Qwen/Qwen3-4B").optim.lr == PRETRAINED_LORA_LR
    assert parse("--model", "Qwen/Qwen3-4B", "--method", "qlora").optim.lr == PRETRAINED_LORA_LR
    assert parse("--model", "Qwen/Qwen3-4B", "--method", "full").optim.lr == PRETRAINED_FULL_LR
    assert parse("--model", "Qwen/Qwen3-4B", "optim.lr=1e-3").optim.lr == 1e-3  # set: kept
    said = derived_line(parse("--model", "Qwen/Qwen3-4B"))
    assert "optim.lr=0.0002: lora on a pretrained checkpoint, optim.lr not set" in said
    # A model trained from a random preset (its lineage.json) learns at the preset's rate.
    model = tmp_path / "model"
    model.mkdir()
    (model / "lineage.json").write_text('{"origin": {"preset": "tiny", "seed": 0}, "stages": []}')
    assert parse("--model", str(model), "--method", "full").optim.lr == RANDOM_PRESET_LR


def test_warm_up_is_a_share_of_the_run_unless_set(capsys):
    from distft.parallel.derive import complete_defaults
    from distft.train.optim import lr_lambda, training_lines, warmup_steps, warmup_warning

    cfg = parse("--model", "micro", "--max-steps", "5")  # neither set: a tenth of the run, rounded up
    assert (cfg.optim.warmup_ratio, warmup_steps(cfg)) == (0.1, 1)
    assert lr_lambda(cfg)(0) == 1.0 and warmup_warning(cfg) is None
    assert "1 warm-up step (0.1 of the run)" in training_lines(cfg, 8)[0]
    assert warmup_steps(parse("--model", "micro", "--max-steps", "1000")) == 100
    assert warmup_steps(parse("--model", "micro", "optim.warmup_ratio=0.25", "--max-steps", "10")) == 3
    steps = parse("--model", "micro", "optim.warmup_steps=10", "--max-steps", "5")  # set: kept, and said
    assert (steps.optim.warmup_ratio, warmup_steps(steps)) == (0.0, 10)
    assert "reaches optim.lr=0.01 never;" in warmup_warning(steps)
    assert "warning: optim.warmup_steps=10 is as long as the run (5 steps)" in training_lines(steps, 8)[1]
    with pytest.raises(ConfigError, match="both set the warm-up: keep one"):
        parse("--model", "micro", "optim.warmup_steps=3", "optim.warmup_ratio=0.2")
    # `train(cfg)` in Python derives as the command line does; a field changed after loading counts as set.
    python = load_config(None, ["model.name=Qwen/Qwen3-4B"])
    python.optim.warmup_steps = 4
    complete_defaults(python)
    assert (python.optim.lr, python.optim.warmup_ratio, warmup_steps(python)) == (PRETRAINED_LORA_LR, 0.0, 4)
    assert "warmup" not in capsys.readouterr().out  # the usual warm-up is said in the header only
