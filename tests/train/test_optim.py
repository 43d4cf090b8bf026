"""Optimizers, schedules, LoRA variants and LoRA+, epochs, master weights: what each setting does,
and what each strategy refuses before launch.

One in-process run (a bf16 full finetune over fp32 master weights, its length in epochs), and
8-bit AdamW's runs (one process, two DDP ranks, a resume); the rest builds models or reads configs. The data-parallel parity of DoRA and LoRA+ is in
tests/parallel/test_data_parallel.py, their exact resume in tests/test_checkpoint.py.
"""

import importlib.util
import math

import pytest
import torch
from safetensors import safe_open

from distft.cli import main
from distft.config import load_config
from distft.errors import ConfigError
from distft.model import apply_method, load_base_model
from distft.parallel import check_config, master_weights
from distft.train import train
from distft.train.optim import check_optimizer, lr_lambda, lr_scaling_hint, param_groups, training_lines
from tests.helpers import PARITY, adapter, assert_same_training, crashed_copy, distft, metrics

QUICK = ["model.name=micro", "data.max_length=256", "data.max_rows=8", "train.global_batch_size=4"]


def test_a_steps_record_holds_the_learning_rate_its_update_used(tmp_path):
    """Step s's `lr` is the rate its optimizer step ran at (the schedule at s - 1), not the next
    step's: over a warm-up of 2, half the rate, then the whole of it."""
    run = [
        "train",
        "--model",
        "micro",
        "train.max_steps=3",
        "optim.warmup_steps=2",
        "optim.scheduler=constant",
    ]
    assert (
        main(
            [
                *run,
                "data.max_rows=8",
                "train.global_batch_size=2",
                "train.eval_batches=0",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    cfg = load_config(tmp_path / "config.toml", [])
    factor = lr_lambda(cfg)
    assert [m["lr"] for m in metrics(tmp_path)] == [cfg.optim.lr * factor(s - 1) for s in (1, 2, 3)]
    assert [m["lr"] for m in metrics(tmp_path)][:2] == [cfg.optim.lr / 2, cfg.optim.lr]


def test_schedules_share_the_warm_up_and_end_at_the_floor():
    shape = ["train.max_steps=20", "optim.warmup_steps=4", "optim.min_lr_ratio=0.1"]
    f = {
        s: lr_lambda(load_config(None, [*shape, f"optim.scheduler={s}"]))
        for s in ("cosine", "linear", "constant")
    }
    for factor in f.values():
        assert [factor(i) for i in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f["cosine"](19) == pytest.approx(0.1) and f["linear"](19) == pytest.approx(0.1)
    assert f["linear"](4 + 15 // 2) < f["cosine"](4 + 15 // 2) + 0.05  # both halfway at mid-run
    assert f["linear"](10) == pytest.approx(0.1 + 0.9 * (1 - 6 / 15))
    assert all(f["constant"](i) == 1.0 for i in range(4, 20))


def test_lora_plus_groups_rslora_scale_and_target_presets():
    cfg = load_config(
        None,
        [
            "model.name=micro",
            "lora.lr_ratio=16",
            "lora.variant=rslora",
            "lora.target_modules=attention",
            "lora.rank=4",
        ],
    )
    torch.manual_seed(0)
    model = apply_method(load_base_model(cfg.model), cfg)
    groups = param_groups(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    assert len(groups) == 2 and groups[1]["lr"] == pytest.approx(cfg.optim.lr * 16)
    assert all(".lora_B." in names[id(p)] for p in groups[1]["params"])
    assert all(".lora_A." in names[id(p)] for p in groups[0]["params"])
    adapted = {n.split(".")[-4] for n, p in model.named_parameters() if p.requires_grad}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert q.scaling["default"] == pytest.approx(cfg.lora.alpha / math.sqrt(4))  # rsLoRA: alpha / sqrt(r)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.strategy=tp", "parallel.nproc=2", "lora.variant=dora"], "DoRA runs with single, ddp"),
        (["parallel.strategy=tp-sp", "parallel.nproc=2", "lora.variant=dora"], "magnitude vector"),
        (
            ["parallel.strategy=fsdp+tp", "parallel.nproc=2", "parallel.tp=2", "lora.variant=dora"],
            "partial norm",
        ),
        (["train.method=qlora", "lora.variant=dora"], "cannot dequantize distft's NF4"),
        (["parallel.strategy=fsdp", "parallel.nproc=2", "optim.name=adamw-8bit"], "It runs with single, ddp"),
        (["parallel.strategy=zero1", "parallel.nproc=2", "optim.name=adamw-8bit"], "builds adamw or sgd"),
        (
            ["parallel.strategy=pp", "parallel.nproc=2", "train.method=full", "train.master_weights=fp32"],
            "fp32 masters run with single, ddp, zero1, zero2, fsdp, hsdp",
        ),
    ],
)
def test_refused_before_launch_with_the_alternative(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_config(load_config(None, ["model.name=micro", "train.global_batch_size=8", *overrides]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.epochs=2", "train.max_steps=10"], "both set the length of the run"),
        (["lora.target_modules=attention,q_proj"], "stands alone"),
        (["train.method=full", "lora.variant=dora"], "trains no adapter"),
        (["optim.name=adam"], "Did you mean `adamw`"),
        (["optim.scheduler=cosine_with_restarts"], "choose one of cosine, linear, constant"),
    ],
)
def test_config_mistakes(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_adamw_8bit_without_bitsandbytes_is_refused(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    with pytest.raises(ConfigError, match="needs bitsandbytes"):
        check_optimizer(load_config(None, ["optim.name=adamw-8bit"]), "cpu")


def test_adamw_8bit_trains_under_ddp_as_in_one_process_and_resumes_exactly(tmp_path):
    """bitsandbytes' 8-bit AdamW (a dev dependency: it steps on the CPU from 0.50) in a real run:
    its state is 8-bit (checked beside the planner's bytes in tests/plan/test_counted.py), two DDP
    ranks train as one process does on the same global batch, and a run cut after step 2 resumes
    from its checkpoint to the same adapter, bit for bit (the quantized state round-trips)."""
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    eight_bit = [*PARITY, "optim.name=adamw-8bit", "output.checkpoint_every=1"]
    assert main(["train", *eight_bit, "--out", str(single)]) == 0
    distft("train", *eight_bit, "--strategy", "ddp", "--nproc", "2", "--out", str(ddp))
    assert_same_training(ddp, single, rtol=1e-4)
    first = metrics(single)
    assert first[-1]["loss"] < first[0]["loss"]  # it learns

    cut = crashed_copy(single, tmp_path / "cut", after_step=2)
    assert main(["train", "--resume", str(cut)]) == 0
    assert [m["loss"] for m in metrics(cut)] == [m["loss"] for m in first]
    resumed, whole = adapter(cut), adapter(single)
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)


def test_lr_hint_square_root_for_adam_linear_for_sgd():
    adam = load_config(
        None, ["optim.lr=1e-4", "optim.tuned_global_batch_size=32", "train.global_batch_size=128"]
    )
    assert "square-root scaling (Adam) suggests optim.lr=0.0002 (not applied)" in lr_scaling_hint(adam)
    sgd = load_config(None, ["optim.name=sgd", "optim.lr=0.1", "optim.tuned_global_batch_size=256"])
    assert "linear scaling (SGD) suggests optim.lr=0.00313" in lr_scaling_hint(sgd)
    assert lr_scaling_hint(load_config(None, ["optim.tuned_global_batch_size=8"])) is None  # the same batch


def test_master_weights_resolve_per_strategy():
    def resolved(*overrides):
        return master_weights(load_config(None, ["train.method=full", "model.dtype=bfloat16", *overrides]))

    assert resolved() == "fp32" and resolved("parallel.strategy=fsdp") == "fp32"
    assert resolved("parallel.strategy=tp") == "model" and resolved("train.master_weights=model") == "model"
    assert master_weights(load_config(None, ["train.method=full"])) == "model"  # fp32 already


def test_a_preference_runs_epochs_count_pairs():
    cfg = load_config(None, ["train.objective=orpo", "train.epochs=1", "train.global_batch_size=4"])
    cfg.train.max_steps = 3  # derived from the epochs
    assert "max_steps 3 = ceil(1 x 12 pairs / global batch 4)" in training_lines(cfg, 12)[1]


def test_epochs_and_fp32_masters_in_process(tmp_path, capsys):
    """A bf16 full finetune: fp32 weights while it trains, bf16 in the export; half an epoch of 8
    rows at a global batch of 4 is one step, shown in the header and kept out of config.toml."""
    out = tmp_path / "run"
    cfg = load_config(
        None,
        [*QUICK, "train.method=full", "model.dtype=bfloat16", "train.epochs=0.5", "train.micro_batch_size=4",
         "train.eval_every=0", "train.eval_batches=1", "optim.name=sgd", f"output.dir={out}"],
    )  # fmt: skip
    result = train(cfg)
    printed = capsys.readouterr().out
    assert "train.epochs=0.5: max_steps 1 = ceil(0.5 x 8 rows / global batch 4)" in printed
    assert "master weights fp32: fp32 weights, gradients and optimizer state, bf16 compute" in printed
    assert "optimizer sgd (lr 0.01, momentum 0.9)" in printed
    assert len(result.losses) == 1 and math.isfinite(result.losses[0])
    assert {p.dtype for p in result.model.parameters()} == {torch.float32}  # the masters
    assert "max_steps" not in (out / "config.toml").read_text()  # derived again on resume
    assert load_config(out / "config.toml").train.epochs == 0.5
    with safe_open(out / "model" / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118 (no __iter__)
