"""Time per step and time to train (`distft.plan.timing`): the step's FLOPs are the runtime's own
count, compute is FLOPs / (peak x MFU) on a hand-computed model, the bubble and exposed
communication add as stated, the run scales with its epochs, and a device without a bf16 peak
gets no time at all."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from distft.cli import build_parser, main
from distft.config import load_config
from distft.measure.flops import ModelFlops
from distft.measure.gpus import find_gpu
from distft.model import apply_method, load_base_model
from distft.plan import evaluate, make_request
from distft.plan.estimate import estimate, parallelism_for
from distft.plan.hardware import GiB, format_seconds, generic_gpu
from distft.plan.inputs import Training, holds_last_stage, rank_layers
from distft.plan.model_spec import ModelSpec, resolve_model
from distft.plan.timing import (
    ASSUMED_MFU,
    MOE_MFU_NOTE,
    RunLength,
    model_flops,
    parse_tokens,
    step_time,
)
from distft.plan.traffic import step_collectives

# A model small enough to count by hand: hidden 64, MLP 128, 2 layers of 2 heads x 32 (no GQA),
# vocabulary 1000. Per layer q, k, v, o are 64 x 64 and gate, up, down 128 x 64: 40,960 weights.
HAND = ModelSpec("hand", 1000, 64, 128, 2, 2, 2, 32, True, qk_norm=False, family="llama")
FULL = Training(method="full", seq_len=128, micro_batch=2, label_tokens=128)
# Full finetuning, per sequence of 128 tokens, all labelled: 6N per token for the layers' 81,920
# weights, 6 L d_attn s^2 for attention, 6 x 64,000 per token for the (trained, tied) head.
PER_SEQUENCE = 128 * 6 * 81_920 + 6 * 2 * 64 * 128**2 + 128 * 6 * 64_000  # = 124,649,472


def request(spec: ModelSpec, training: Training, gpu: str = "h100", gpus: int = 1, **kw):
    args = build_parser().parse_args(["plan", "--model", "tiny", "--gpu", gpu, "--gpus", str(gpus)])
    return replace(make_request(args), model=spec, training=training, **kw)


def test_the_planner_counts_the_runtimes_flops():
    """`model_flops` from an architecture equals `ModelFlops.from_model` on the built model."""
    cfg = load_config(None, ["model.name=micro", "train.method=lora", "lora.rank=16"])
    built = ModelFlops.from_model(apply_method(load_base_model(cfg.model), cfg))
    assert model_flops(resolve_model("micro"), Training(method="lora", lora_rank=16)) == built
    assert model_flops(HAND, FULL).sequence(128, 128) == PER_SEQUENCE == 124_649_472


def test_step_time_on_one_gpu_is_flops_over_peak_times_mfu():
    req = request(HAND, FULL, mfu=0.5)
    est = estimate(req, parallelism_for(req, "single"))
    assert est.step_s == pytest.approx(2 * PER_SEQUENCE / (989e12 * 0.5))  # H100 SXM: 989 TFLOP/s
    assert est.tokens_per_s == pytest.approx(256 / est.step_s)
    assert est.time.flops == 2 * PER_SEQUENCE
    # Without --mfu: distft's measured MFU for the method (full finetuning 43%).
    est = estimate(request(HAND, FULL), parallelism_for(req, "single"))
    assert est.step_s == pytest.approx(2 * PER_SEQUENCE / (989e12 * ASSUMED_MFU["full"]))
    # Checkpointing adds the layers' forward once more: 2N per token and 2 L d_attn s^2.
    ckpt = estimate(
        request(HAND, replace(FULL, activation_checkpointing="full"), mfu=0.5), parallelism_for(req, "single")
    )
    again = 2 * (128 * 2 * 81_920 + 2 * 2 * 64 * 128**2)
    assert ckpt.step_s == pytest.approx((2 * PER_SEQUENCE + again) / (989e12 * 0.5))
    # A preference objective's forwards without backward (DPO's reference, KTO's KL term with it):
    # 2N per token, 2 L d_attn s^2 and the head's forward, per sequence and run; the time is each
    # run's FLOPs over the same peak.
    forward = 128 * 2 * 81_920 + 2 * 2 * 64 * 128**2 + 128 * 2 * 64_000
    for runs, training in [
        (1, replace(FULL, reference_forward=True)),
        (3, replace(FULL, reference_forward=True, kl_forwards=2)),
    ]:
        est = estimate(request(HAND, training, mfu=0.5), parallelism_for(req, "single"))
        assert est.time.flops == 2 * (PER_SEQUENCE + runs * forward)
        assert est.step_s == pytest.approx(2 * (PER_SEQUENCE + runs * forward) / (989e12 * 0.5))


def test_communication_and_the_bubble_add_as_stated():
    req = request(HAND, FULL, gpus=2, mfu=0.5)
    ddp = estimate(req, parallelism_for(req, "ddp", dp=2))  # overlapped: only what outlasts compute shows
    hidden = sum(c.seconds for c in ddp.collectives if c.overlapped)  # the gradients
    loss = sum(c.seconds for c in ddp.collectives if not c.overlapped)  # the loss, after backward
    assert (
        loss > 0
        and ddp.time.overlapped_s == pytest.approx(hidden)
        and ddp.time.blocking_s == pytest.approx(loss)
    )
    assert ddp.step_s == pytest.approx(ddp.compute_s + max(0.0, hidden - ddp.compute_s) + loss)
    tp = estimate(req, parallelism_for(req, "tp-sp", tp=2))  # on the critical path: all of it shows
    assert tp.time.blocking_s == pytest.approx(sum(c.seconds for c in tp.collectives if not c.overlapped))
    assert tp.compute_s == pytest.approx(2 * PER_SEQUENCE / 2 / (989e12 * 0.5))  # SP splits the head too
    par = parallelism_for(req, "pp", pp=2)
    pp = estimate(req, par)
    busiest = max(  # the slowest stage sets the pace; the bubble is the layout's own idle share
        model_flops(HAND, FULL, rank_layers(HAND, FULL, par, r), holds_last_stage(par, r)).sequence(128, 128)
        for r in range(2)
    )
    assert pp.compute_s == pytest.approx(busiest * 2 * par.microbatches / (989e12 * 0.5))
    f = par.idle_fraction()
    assert f > 0 and pp.time.bubble_s == pytest.approx(pp.compute_s * f / (1 - f))


def test_time_to_train_scales_with_epochs_and_takes_steps_as_given():
    assert RunLength(tokens=1_000_000).steps_for(4096) == math.ceil(1_000_000 / 4096) == 245
    assert RunLength(tokens=1_000_000, epochs=3).steps_for(4096) == math.ceil(3_000_000 / 4096)
    assert RunLength(tokens=1_000_000, steps=10).steps_for(4096) == 10  # --steps wins
    assert RunLength().steps_for(4096) is None
    one, three = (
        evaluate(request(HAND, FULL, run=RunLength(tokens=10**9, epochs=e)))["single"] for e in (1, 3)
    )
    assert three.run_steps == math.ceil(3e9 / 256) and three.train_s == pytest.approx(3 * one.train_s)
    assert parse_tokens("1.2B") == 1_200_000_000 and parse_tokens("50M") == 50_000_000


def test_no_bf16_peak_no_time():
    for gpu in (replace(generic_gpu(16 * GiB), label="cpu"), generic_gpu(24 * GiB)):
        collectives = step_collectives(
            HAND, FULL, parallelism_for(request(HAND, FULL), "single"), request(HAND, FULL).topology
        )
        assert (
            step_time(HAND, FULL, parallelism_for(request(HAND, FULL), "single"), collectives, gpu, 0.4)
            is None
        )
    req = replace(request(HAND, FULL), gpu=replace(generic_gpu(16 * GiB), label="cpu"))
    est = evaluate(req)["single"]
    assert est.step_s is None and est.tokens_per_s is None and est.train_s is None
    assert req.no_time == "no bf16 peak for cpu"


def test_plan_reports_hours_for_a_known_model(capsys):
    cmd = ["plan", "--model", "qwen3-4b", "--gpus", "8", "--gpu", "h100", "--tokens", "1B"]
    assert main(cmd) == 0
    out = " ".join(capsys.readouterr().out.split())
    req = make_request(build_parser().parse_args(cmd))
    ddp = evaluate(req)["ddp"]  # the recommendation: Qwen3-4B LoRA fits one H100
    steps = math.ceil(1e9 / ddp.tokens_per_step)
    assert ddp.run_steps == steps and ddp.train_s == pytest.approx(steps * ddp.step_s)
    assert (
        f"time: {format_seconds(ddp.step_s)} per step, {ddp.tokens_per_s:,.0f} tokens/s; {steps:,} steps"
        in out
    )
    assert f"{ddp.train_s / 3600:,.1f} h on 8 GPUs" in out and "train.max_steps=" in out
    assert main([*cmd, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["recommendation"]["time"]["train_hours"] == pytest.approx(ddp.train_s / 3600)
    assert (
        doc["time_model"]["mfu_assumed"] == ASSUMED_MFU["lora"] and doc["time_model"]["unavailable"] is None
    )


def test_a_gpu_known_only_by_memory_says_why_it_has_no_time(capsys):
    assert main(["plan", "--model", "tiny", "--gpu-mem", "20GiB", "--steps", "100"]) == 0
    out = capsys.readouterr().out
    assert "time: n/a (no bf16 peak for custom GPU 20 GiB)" in " ".join(out.split())
    assert find_gpu("l4").bf16_tflops == 121.0


@pytest.mark.parametrize("model,moe", [("qwen3-30b-a3b", True), ("qwen3-4b", False)])
def test_a_mixture_of_experts_says_its_mfu_is_a_dense_measurement(model, moe, capsys):
    """The assumed MFU is measured on dense Qwen3-4B: an MoE's plan says so, in the text and the
    JSON, and prices its step by the active parameters' FLOPs (a token's top-k experts)."""
    cmd = ["plan", "--model", model, "--gpus", "2", "--gpu", "h100"]
    assert main(cmd) == 0
    assert (MOE_MFU_NOTE in " ".join(capsys.readouterr().out.split())) == moe
    assert main([*cmd, "--json"]) == 0
    assert (MOE_MFU_NOTE in json.loads(capsys.readouterr().out)["time_model"]["mfu_source"]) == moe
    req = make_request(build_parser().parse_args(cmd))
    est = evaluate(req)["fsdp"]
    per_token = est.time.flops / est.tokens_per_step
    # LoRA: about 4 FLOPs per weight a token meets (forward, input gradient), plus attention; counting
    # every expert would be 9x the active parameters for this MoE.
    assert 2 * req.model.active_params() < per_token < 6 * req.model.active_params()
    if moe:
        assert 5 * req.model.active_params() < req.model.num_params()
