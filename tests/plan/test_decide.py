"""The decision tree on the seeds' scenarios, the seeds' figures, the hardware model and the CLI.

Each scenario is a `distft plan` command line; the test asserts the recommendation and the reason
it gives, as a user reads them. No network: hub ids resolve from the built-in table.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from distft.cli import build_parser, main
from distft.errors import ConfigError
from distft.measure.gpus import GB
from distft.model.nf4 import NF4Spec
from distft.parallel import check_config
from distft.plan import evaluate, make_request
from distft.plan.activations import inflight_microbatches
from distft.plan.decide import decide
from distft.plan.estimate import estimate, max_micro_batch
from distft.plan.explain import inter_node_bytes
from distft.plan.hardware import LINKS, GiB, comm_time, parse_bytes, wire_bytes
from distft.plan.inputs import PRECISIONS, Parallelism, Training
from distft.plan.memory import chunk_rows, nf4_tensor_bytes, state_bytes
from distft.plan.model_spec import resolve_model
from distft.plan.report import largest_micro_batch
from distft.plan.run_line import run_command
from tests.plan.test_run_line import parse_run


def plan(command: str):
    req = make_request(build_parser().parse_args(["plan", *command.split()]))
    estimates = evaluate(req)
    return req, estimates, decide(req, estimates)


def answers(rec) -> dict[str, str]:
    return {s.question.split(".")[0]: s.answer for s in rec.steps}


# ---- the seeds' scenarios ----------------------------------------------------------------------

SCENARIOS = [
    # (command line, recommended strategy, method, words the reason must contain)
    (  # Qwen3-4B LoRA on the series' 2x RTX 4090 over PCIe: it fits one card, so DDP for throughput.
        "--model Qwen/Qwen3-4B --method lora --gpus 2 --gpu-mem 24GiB --interconnect pcie --seq-len 2048",
        "ddp",
        "lora",
        ["fits on one GPU", "throughput with DDP"],
    ),
    (  # 13B full finetuning on one A100 80GB: no; LoRA on the one GPU does.
        "--model meta-llama/Llama-2-13b-hf --method full --gpu a100-80gb --seq-len 4096 --activation-checkpointing",
        "single",
        "lora",
        ["Full finetuning needs more memory", "LoRA fits"],
    ),
    (  # 13B full finetuning on eight 24 GB cards: fits nowhere (208 GB of state); QLoRA + DDP does.
        "--model llama-2-13b --method full --gpus 8 --gpu rtx4090 --activation-checkpointing",
        "ddp",
        "qlora",
        ["Full finetuning needs more memory", "QLoRA fits"],
    ),
    (  # ... on two such nodes (16 cards) full finetuning fits with FSDP; HSDP (1/8 per card) does not.
        "--model llama-2-13b --method full --gpus 8 --nodes 2 --gpu rtx4090 --activation-checkpointing",
        "fsdp",
        "full",
        ["FSDP over all 16 GPUs", "HSDP would keep the gathers inside each node", "does not fit"],
    ),
    (  # Weights and gradients fit one card, AdamW's state does not: ZeRO.
        "--model qwen3-1.7b --method full --gpus 2 --gpu rtx4090 --activation-checkpointing",
        "zero1",
        "full",
        ["only the optimizer state does not"],
    ),
    (  # ... the seeds' 13B on 8 A100s: 156 GB of state; weights and gradients fit an 80 GB card.
        "--model llama-2-13b --method full --gpus 8 --gpu a100-80gb --activation-checkpointing",
        "zero1",
        "full",
        ["only the optimizer state does not", "keeping DDP's gradient all-reduce"],
    ),
    (  # 32B full finetuning across 4 nodes: FSDP fits but all-gathers over InfiniBand; HSDP keeps
        # them inside each node and sends 1/8 of the gradients across, once per step.
        "--model qwen3-32b --method full --gpus 8 --nodes 4 --gpu h100 --interconnect infiniband "
        "--activation-checkpointing",
        "hsdp",
        "full",
        ["HSDP (shard=8, replicas=4) fits", "stay inside each node", "all-reduce of 1/8 of the gradients"],
    ),
    (  # Sharding needed on PCIe: FSDP's weight traffic cannot hide behind compute, TP+SP wins.
        "--model qwen3-14b --method lora --gpus 2 --gpu rtx4090 --seq-len 512 --activation-checkpointing",
        "tp-sp",
        "lora",
        ["slow for FSDP", "TP+SP moves activations", "faster"],
    ),
    (  # ... the same question on NVLink: FSDP's traffic hides behind compute.
        "--model qwen3-32b --method lora --gpus 4 --gpu a100-40gb --seq-len 512 --activation-checkpointing",
        "fsdp",
        "lora",
        ["hides behind compute"],
    ),
    (  # 70B on one 8-GPU node at 4k tokens: FSDP shards the weights, not the activations. TP+SP splits
        # them (was FSDP x TP, modelled with SP; the runtime's fsdp+tp is plain parallelize_module TP
        # inside, parallel/fsdp_tp.py, and at 4k tokens its activations no longer fit an H100).
        "--model llama-3-70b --method lora --gpus 8 --gpu h100 --seq-len 4096",
        "tp-sp",
        "lora",
        ["because of activations", "sequence parallelism"],
    ),
    (  # 70B full finetuning across 4 nodes: torchtitan's 3D. TP and FSDP inside each node on NVLink, a
        # pipeline across nodes ("PP cheaply spans nodes"): FSDP alone or FSDP x TP would all-gather
        # over InfiniBand. FSDP x PP (dp=2, pp=16) is as fast but needs 64 sequences per step, not 16.
        "--model llama-3-70b --method full --gpus 8 --nodes 4 --gpu h100 --interconnect infiniband "
        "--seq-len 4096 --activation-checkpointing",
        "fsdp+tp+pp",
        "full",
        ["point-to-point", "FSDP x TP stays on NVLink", "global batch of at least 16", "(dp=2, tp=4, pp=4)"],
    ),
]


@pytest.mark.parametrize(
    "command,strategy,method,words", SCENARIOS, ids=[s[1] + ":" + s[0][8:30] for s in SCENARIOS]
)
def test_scenario(command, strategy, method, words):
    _, estimates, rec = plan(command)
    assert (rec.strategy, rec.method) == (strategy, method), rec.reason
    for w in words:
        assert w in rec.reason, (w, rec.reason)
    assert estimates[strategy].applicable if method == rec.method else True


def test_13b_full_on_24gb_cards_is_neither_single_nor_ddp():
    _, estimates, rec = plan(
        "--model llama-2-13b --method full --gpus 8 --gpu rtx4090 --activation-checkpointing"
    )
    assert not estimates["single"].fits and not estimates["ddp"].fits
    assert estimates["ddp"].total == estimates["single"].total  # DDP buys throughput, never memory
    steps = answers(rec)
    assert "QLoRA" in steps["0"] and "(fits)" in steps["0"]  # step 0 already says QLoRA fits one card
    assert steps["2"].startswith("No")  # even without AdamW's state the weights + gradients do not fit
    assert any("fits from 16" in a for a in rec.alternatives)  # how many cards full finetuning needs


def test_70b_one_node_offers_checkpointing_and_says_why():
    _, estimates, rec = plan("--model llama-3-70b --method lora --gpus 8 --gpu h100 --seq-len 4096")
    steps = answers(rec)
    assert steps["4"].startswith("Yes")  # sequence length is the problem
    assert not estimates["fsdp"].fits and estimates["tp-sp"].fits
    # The runtime's fsdp+tp has no sequence parallelism (parallel/fsdp_tp.py): its norms, residual
    # stream and loss keep the whole sequence, which at 4k tokens does not fit (it did with SP).
    assert not estimates["fsdp+tp"].fits
    assert any("activation checkpointing" in a for a in rec.alternatives)


def test_qwen3_4b_matches_the_4090_profile_and_walks_steps_0_and_1():
    req, _, rec = plan("--model Qwen/Qwen3-4B --method lora --gpus 2 --gpu-mem 24GiB --interconnect pcie")
    assert req.gpu.name == "rtx4090" and req.intra.name == "pcie4"
    assert req.model.name == "Qwen/Qwen3-4B" and req.model.source == "built-in table"
    assert [s.question[:2] for s in rec.steps] == ["0.", "1."]


# ---- the seeds' figures ------------------------------------------------------------------------


def test_bytes_per_parameter_of_full_finetuning():
    """16 bytes per parameter with AdamW under mixed precision; the seeds' 13B table (bf16 weights and
    gradients, fp32 moments): 26 + 26 + 104 = 156 GB; 70B at 12 bytes ~ 840 GB."""
    spec = resolve_model("llama-2-13b")
    trained = {k: p.param + p.grad + p.master + 2 * p.state for k, p in PRECISIONS.items()}
    assert trained["mixed"] == 16 and trained["bf16"] == 12
    s = state_bytes(spec, Training(method="full", precision=PRECISIONS["bf16"]), Parallelism("single"))
    assert s.params / GB == pytest.approx(26, rel=0.01)
    assert s.grads / GB == pytest.approx(26, rel=0.01)
    assert s.optimizer / GB == pytest.approx(104, rel=0.01)
    big = state_bytes(
        resolve_model("llama-3-70b"),
        Training(method="full", precision=PRECISIONS["bf16"]),
        Parallelism("single"),
    )
    assert big.total / GB == pytest.approx(840, rel=0.02)
    fsdp4 = state_bytes(
        spec, Training(method="full", precision=PRECISIONS["bf16"]), Parallelism.at("fsdp", dp=4)
    )
    assert fsdp4.total / GB == pytest.approx(
        39, rel=0.01
    )  # "156 GB on one device ... roughly 39 GB across four"


def test_lora_trains_only_adapters():
    spec = resolve_model("qwen3-4b")
    lora = state_bytes(spec, Training(method="lora"), Parallelism("single"))
    adapters = sum(t.numel for t in spec.lora_tensors(16))
    assert adapters == 36 * 16 * (
        2560 + 4096 + 2 * (2560 + 1024) + 4096 + 2560 + 2 * (2560 + 9728) + 9728 + 2560
    )
    assert lora.grads == 4 * adapters  # fp32 adapters (PEFT), fp32 gradients
    assert lora.optimizer == 8 * adapters + 4 * len(spec.lora_tensors(16))  # m, v and one step per tensor
    assert lora.params == 2 * spec.num_params() + 4 * adapters  # frozen bf16 base + fp32 adapters


def test_qlora_storage_formula():
    """NF4: half a byte per weight + an absmax per 64: in the model dtype without double quantization,
    or with it an int8 per 64 and a scale per 256 blocks (~0.0159 B/param), plus torchao's per-tensor
    mean and 16-value code book.

    The planner now uses the runtime's storage formula (`distft.model.nf4.nf4_bytes`: torchao's
    NF4Tensor keeps its scales, mean and code book in the model dtype, `itemsize`), no longer its
    own bitsandbytes-style one with fp32 second-level scales; the expected values follow it."""
    n = 64 * 256 * 10
    single = NF4Spec(double_quant=False)
    # torchao keeps a scale per 256 blocks even without double quantization (quantization_factor)
    assert nf4_tensor_bytes(n, single, 4) == n / 2 + n / 64 * 4 + n / 64 / 256 * 4 + 4 + 16 * 4
    assert nf4_tensor_bytes(n, NF4Spec(), 4) == n / 2 + n / 64 + n / 64 / 256 * 4 + 4 + 16 * 4
    assert (
        nf4_tensor_bytes(n, NF4Spec(), 2) == n / 2 + n / 64 + n / 64 / 256 * 2 + 34
    )  # bf16: mean + code book
    spec = resolve_model("llama-2-13b")
    linear = [t for t in spec.tensors() if t.kind == "linear"]
    rest = spec.num_params() - sum(t.numel for t in linear)
    # the frozen bf16 base: NF4 projections with 2-byte scales, 34 bytes of constants per projection
    total = sum(nf4_tensor_bytes(t.numel, NF4Spec(), 2) for t in linear) + 2 * rest
    want = sum(t.numel for t in linear) * (0.5 + 1 / 64 + 2 / 64 / 256) + 34 * len(linear) + 2 * rest
    assert total == pytest.approx(want, rel=1e-6)
    assert total < 8 * GB  # "QLoRA can fit a 13B model ... on a single 24 GB GPU"


def test_fsdp_chunks_and_pipeline_in_flight():
    assert [chunk_rows(5, 2, r) for r in range(2)] == [3, 2]  # torch.chunk: the last rank is short
    assert [chunk_rows(1, 2, r) for r in range(2)] == [1, 0]
    lay = Parallelism.at("pp", pp=4, microbatches=8)
    assert [inflight_microbatches(lay, s)[0] for s in range(4)] == [4, 3, 2, 1]  # 1F1B: min(m, p - s)
    assert inflight_microbatches(Parallelism.at("pp", pp=4, microbatches=8, schedule="gpipe"), 3)[0] == 8
    inter = Parallelism.at("pp", pp=4, microbatches=8, schedule="interleaved-1f1b")
    assert inflight_microbatches(inter, 0) == (min(16, 1 * 4 + 2 * 3 + 1), 2)


# ---- hardware ----------------------------------------------------------------------------------


def test_ring_collective_volumes_and_time():
    link = LINKS["pcie4"]
    assert wire_bytes("all_reduce", 1e9, 2) == 1e9  # 2 (N-1)/N
    assert wire_bytes("all_gather", 8e9, 8) == 7e9  # (N-1)/N
    assert wire_bytes("send", 1e9, 2) == 1e9
    want = 2 * 3 / 4 * 1e9 / (32e9 * 0.7) + 2 * 3 * 15e-6
    assert math.isclose(comm_time("all_reduce", 1e9, 4, link), want)
    assert comm_time("all_reduce", 1e9, 1, link) == 0.0


@pytest.mark.parametrize(
    "text,value", [("24GiB", 24 * GiB), ("80GB", 80 * GB), ("24 G", 24 * GiB), ("512MiB", 512 * 2**20)]
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


# ---- the command line --------------------------------------------------------------------------


def test_json_has_every_strategy_and_component(capsys):
    cmd = ["plan", "--model", "Qwen/Qwen3-4B", "--method", "lora", "--gpus", "2", "--gpu-mem", "24GiB",
           "--interconnect", "pcie", "--json"]  # fmt: skip
    assert main(cmd) == 0
    doc = json.loads(capsys.readouterr().out)
    names = [s["strategy"] for s in doc["strategies"]]
    assert names == [
        "single",
        "ddp",
        "zero1",
        "zero2",
        "fsdp",
        "hsdp",
        "tp",
        "tp-sp",
        "cp",
        "pp",
        "fsdp+tp",
        "ddp+pp",
        "fsdp+pp",
        "fsdp+tp+pp",
        "fsdp+cp",
        "fsdp+ep",
        "hsdp+tp",
    ]
    components = {
        "parameters",
        "gradients",
        "optimizer_states",
        "activations",
        "communication_buffers",
        "total",
    }
    for s in doc["strategies"]:
        if s["applicable"]:
            assert set(s["bytes_per_gpu"]) == components
            assert s["bytes_per_gpu"]["total"] == sum(
                v for k, v in s["bytes_per_gpu"].items() if k != "total"
            )
            assert s["communication"]["seconds_per_step"] >= 0
    rec = doc["recommendation"]
    assert rec["strategy"] == "ddp" and rec["steps"][0]["question"].startswith("0.")
    assert rec["command"].startswith(
        "distft train --model Qwen/Qwen3-4B --method lora --strategy ddp --nproc 2"
    )


def test_rich_output(capsys):
    assert main(["plan", "--model", "tiny", "--gpus", "2", "--gpu", "rtx4090"]) == 0
    out = capsys.readouterr().out
    assert "TP + SP" in out and "recommendation:" in out and "1. Does it fit on one GPU?" in out


def test_pipelined_layouts_print_their_cut_against_the_even_one(capsys):
    """qwen3-4b on 8 GPUs: every pipelined layout's cut, its modelled slowest / mean stage within
    1.10 (one stage per rank), and the even cut's figure beside it."""
    assert main(["plan", "--model", "qwen3-4b", "--gpus", "8", "--gpu", "h100"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "stages, cut" in line]
    assert {line.split(":")[0] for line in lines} >= {"pp", "ddp+pp", "fsdp+pp"}
    for line in lines:
        balanced, even = (float(part.rsplit(" ", 1)[1].rstrip(";")) for part in line.split("; even cut "))
        assert balanced <= min(even, 1.10), line


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "acme/NoSuchModel-7B", "--gpu", "h100"], "offline"),
        (["--model", "no-such-preset", "--gpu", "h100"], "Unknown model"),
        (["--model", "tiny", "--gpu-mem", "24 bananas"], "not a memory size"),
        (["--model", "tiny", "--gpu-mem=-3GiB"], "not a memory size"),
        (["--model", "tiny", "--gpu", "h100", "--gpus", "0"], "--gpus must be a positive integer"),
        (["--model", "tiny"], "Say what the GPUs are"),
        (["--model", "tiny", "--gpu", "tpu-v5"], "Unknown --gpu"),
    ],
)
def test_bad_input_is_one_paragraph_and_exit_2(args, message, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("distft plan: error:")
    assert err.strip().count("\n") == 0  # one paragraph


def test_hub_fetch_failure_is_a_config_error(monkeypatch):
    """Online, an unknown hub id is fetched (config.json only); any failure is a ConfigError."""
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)

    def unreachable(*args, **kwargs):
        raise OSError("Connection refused")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", unreachable)
    monkeypatch.setattr("distft.plan.model_spec.hub_offline", lambda: False)  # as if the probe connected
    with pytest.raises(ConfigError, match="could not be fetched"):
        resolve_model("acme/NoSuchModel-7B")
    # A hub out of reach (no HF_HUB_OFFLINE) is not asked at all: huggingface_hub retries ~30 s.
    monkeypatch.setattr("distft.plan.model_spec.hub_offline", lambda: True)
    with pytest.raises(ConfigError, match="the hub is offline or out of reach"):
        resolve_model("acme/NoSuchModel-7B")


def test_local_config_json(tmp_path):
    cfg = {
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "tie_word_embeddings": True,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = resolve_model(str(tmp_path))
    assert spec.num_params() == resolve_model("qwen3-4b").num_params() and spec.qk_norm
    # A Qwen3-MoE config.json: every expert counted, a token's top-k active.
    moe = {
        **cfg,
        "model_type": "qwen3_moe",
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 512,
    }
    (tmp_path / "config.json").write_text(json.dumps(moe))
    spec = resolve_model(str(tmp_path))
    experts = 36 * 16 * 3 * 512 * 2560
    dense_mlp = 36 * 3 * 9728 * 2560
    assert spec.num_params() == resolve_model("qwen3-4b").num_params() - dense_mlp + experts + 36 * 16 * 2560
    assert spec.num_params() - spec.active_params() == experts // 16 * 14
    # Layouts the planner does not know: another family's experts, dense layers among the MoE ones.
    for other in ({**moe, "model_type": "mixtral", "num_local_experts": 8}, {**moe, "mlp_only_layers": [0]}):
        (tmp_path / "config.json").write_text(json.dumps(other))
        with pytest.raises(ConfigError, match="the planner cannot count"):
            resolve_model(str(tmp_path))


def test_plan_says_the_largest_micro_batch_that_fits(capsys):
    """The recommendation's layout fits with that many sequences per micro-batch, and not one more."""
    req, _, rec = plan("--model qwen3-4b --gpu h100 --gpus 1 --seq-len 2048 --micro-batch 2")
    largest = largest_micro_batch(req, rec)
    assert rec.strategy == "single" and largest >= 2

    def fits(m: int) -> bool:
        return estimate(
            replace(req, training=replace(req.training, micro_batch=m)), rec.parallelism, rec.strategy
        ).fits

    assert fits(largest) and not fits(largest + 1)
    assert max_micro_batch(req, rec.parallelism, rec.strategy, limit=3) == 3  # capped
    tiny_gpu, _, tiny_rec = plan("--model qwen3-4b --gpu-mem 2GiB --gpus 1 --seq-len 2048")
    assert max_micro_batch(tiny_gpu, tiny_rec.parallelism or Parallelism("single"), "single") == 0
    assert main(["plan", "--model", "qwen3-4b", "--gpu", "h100", "--gpus", "1", "--seq-len", "2048"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"largest micro-batch that fits: {largest} sequences of 2048 tokens" in out


def test_fsdp_cp_where_activations_are_the_problem_and_nothing_else_holds_them():
    """Qwen3-4B at 131k positions on four 24 GiB GPUs: FSDP's weights fit but not its activations;
    context parallelism splits every sequence and is the fastest; FSDP x CP, as fast, shards the
    weights too, and the tree picks it over CP, its `run:` line running that layout."""
    req, est, rec = plan(
        "--model Qwen/Qwen3-4B --gpu-mem 24GiB --interconnect nvlink --gpus 4 --seq-len 131072 "
        "--rope-scaling yarn --rope-factor 4 --activation-checkpointing full"
    )
    assert not est["fsdp"].fits and not est["fsdp+tp"].fits and est["fsdp+cp"].fits and est["cp"].fits
    assert est["fsdp+cp"].total < est["cp"].total  # the weights sharded too, at CP's speed
    assert est["fsdp+cp"].tokens_per_s >= max(est[s].tokens_per_s for s in ("cp", "tp-sp"))
    assert rec.strategy == "fsdp+cp" and "splits every sequence's positions" in rec.reason
    line = run_command(req, rec.strategy, rec.method, rec.activation_checkpointing, rec.parallelism)
    assert "--strategy fsdp+cp" in line and "parallel.cp=4" in line


def test_hsdp_tp_in_place_of_fsdp_tp_across_nodes():
    """Llama 3 70B LoRA at 4k on 2 nodes of 8 H100s: FSDP x TP is the layout (TP on NVLink inside
    each node); HSDP x TP holds it at about the same speed with FSDP's gathers kept inside each
    node, and the tree picks it, with a `run:` line that passes the checks before launch."""
    req, est, rec = plan("--model llama-3-70b --method lora --gpus 8 --nodes 2 --gpu h100 --seq-len 4096")
    hybrid, flat = est["hsdp+tp"], est["fsdp+tp"]
    assert rec.strategy == "hsdp+tp" and "FSDP x TP fits at about that speed" in rec.reason, rec.reason
    assert hybrid.fits and flat.fits and hybrid.parallelism.tp == flat.parallelism.tp
    assert hybrid.parallelism.dp_shard * hybrid.parallelism.tp == req.gpus_per_node  # a node per group
    assert inter_node_bytes(hybrid, req) < inter_node_bytes(flat, req) / 4
    line = run_command(req, rec.strategy, rec.method, rec.activation_checkpointing, rec.parallelism)
    cfg = parse_run(line)
    assert check_config(cfg).data_parallel_size == hybrid.parallelism.dp and "parallel.shard=" in line
