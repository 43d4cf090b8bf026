"""Qwen3-MoE (`qwen3-moe-micro`: 8 experts, each token routed to 2) under every strategy that takes
a mixture of experts, against one process on the same global batch: LoRA on attention and on every
expert (peft's parameter adapters on the fused stacks), and full finetuning, which trains the
experts and the router. The adapter is an ordinary PEFT adapter that plain peft loads; what cannot
run an MoE is refused before launch, in one line."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from distft.cli import build_parser, main
from distft.layout import SPECS
from distft.model import PRESETS
from distft.model.families import FAMILIES
from distft.plan import evaluate, make_request
from distft.plan.collective import bytes_by_dim, bytes_by_kind
from distft.plan.inputs import Parallelism
from distft.plan.memory import state_bytes
from tests.batched import trained
from tests.helpers import PARITY, adapter, assert_same_training, crashed_copy, distft, metrics

# Adam's eps above the rounding of a gradient element (~2e-9 here): at the default 1e-8, an element
# whose first gradient is itself ~1e-8 moves by lr g / (|g| + eps), and another summation order (tp
# sums each expert's features in halves) turns 1.4e-8 against 1.6e-8 into 3% of a step.
# Rows of 160 tokens (PARITY's 384 cost 2.4x as much a step): near the least the sample's rows need.
MOE = [
    *(a if a != "micro" else "qwen3-moe-micro" for a in PARITY),
    *("data.max_rows=16", "optim.eps=1e-6", "data.max_length=192"),
]
MOE_STRATEGIES = [name for name, spec in SPECS.items() if spec.runs("moe") and name != "single"]


def assert_all_to_all_bytes(run, micro_batches: int, forwards: int = 1) -> None:
    """fsdp+ep's all-to-all bytes, summed over the ranks, are the analytic count: every token's k
    rows of hidden floats (4 bytes) there and back in each forward (`forwards`: 2 where activation
    checkpointing recomputes it) and in backward, in each of the 4 MoE layers, and each forward's
    per-expert counts (8 int64) per layer. A rank's own share depends on the routing (what it
    sends, and what it receives); the sum does not."""
    tokens = metrics(run)[-1]["tokens"]  # every row fills data.max_length: each step the same
    ranks = json.loads((run / "ranks.json").read_text())
    counted = sum(rank["comm_bytes_per_step"]["counted"]["all_to_all"] for rank in ranks)
    hidden, k, layers, experts = 32, 2, 4, 8
    rows = tokens * k * hidden * 4 * layers * 2 * (forwards + 1)  # dispatch and combine
    assert counted == rows + len(ranks) * micro_batches * forwards * layers * experts * 8


def assert_tp_bytes(run, micro_batches: int) -> None:
    """tp's all-reduce bytes of step 1 on one rank are the analytic count, in fp32 (4 bytes) over
    micro-batches of T tokens. Per layer and micro-batch: attention's as on a dense model (forward
    o_proj's output and its lora_A's rank-r sum; backward the input of q, k, v, but in the first
    layer, whose input needs no gradient, and of their lora_B), and the experts': their output
    forward, the gradients of their input and of the k routing weights backward. After backward
    the partial gradients of each layer's gate_up lora_A and down lora_B (r x experts x hidden
    each), and the gradient norm's float64."""
    first = metrics(run)[0]
    t, hidden, r, k, layers, experts = first["tokens"] // micro_batches, 32, 16, 2, 4, 8
    attention = layers * (t * hidden + t * r) + (layers - 1) * 3 * t * hidden + layers * 3 * t * r
    moe = layers * (2 * t * hidden + t * k)
    partial = layers * 2 * r * experts * hidden
    assert first["comm_bytes"] == {"all_reduce": 4 * (micro_batches * (attention + moe) + partial) + 8}


def assert_planned_bytes(run) -> None:
    """The planner's bytes per step (the run's prediction, made before launch from the config) are
    the bytes each rank counted, kind by kind (FSDP's without the experts under EP; the router's
    statistics in the loss's all-reduce), and where fsdp+ep's expert groups are smaller than the
    world, dimension by dimension too. The all-to-alls are planned as their mean: a rank's combine
    sends the rows its experts took, which the routing decides; their sum is exact."""
    ranks = [rank["comm_bytes_per_step"] for rank in json.loads((run / "ranks.json").read_text())]
    for comm in ranks:
        other = {k: v for k, v in comm["predicted"].items() if k != "all_to_all"}
        assert other == {k: v for k, v in comm["counted"].items() if k != "all_to_all"}, (run.name, comm)
    planned = sum(comm["predicted"].get("all_to_all", 0) for comm in ranks)
    assert planned == sum(comm["counted"].get("all_to_all", 0) for comm in ranks), run.name
    for record in (r for r in metrics(run) if "comm_bytes_expected_by_dim" in r):
        routed = record["comm_bytes_by_dim"]["ep"].pop("all_to_all")
        assert record["comm_bytes_expected_by_dim"]["ep"].pop("all_to_all") > 0 < routed
        assert record["comm_bytes_by_dim"] == record["comm_bytes_expected_by_dim"], run.name


def expert_groups(run) -> dict[str, list[list[int]]]:
    """Each rank's groups along fsdp+ep's expert mesh ("replicate", "ep"), from ranks.json."""
    ranks = json.loads((run / "ranks.json").read_text())
    return {dim: [rank["mesh"][dim] for rank in ranks] for dim in ("replicate", "ep")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "single"
    assert main(["train", *MOE, "--out", str(out)]) == 0
    return out


def test_lora_on_attention_and_every_expert_trains_as_one_process(reference, tmp_path):
    """Every strategy that takes a mixture of experts trains it with LoRA as one process does in
    tests/parallel/test_families.py (the `qwen3_moe` family). Here, what the experts add: tp's
    all-reduces against a hand count (each rank every expert's half of the intermediate dimension,
    adapters cut with it); fsdp+ep on 4 ranks in 2 expert groups of 2 (each rank 4 experts, tokens
    sent by all-to-all inside its group, the frozen stacks FSDP-sharded across the groups and
    gathered for each layer's experts) and on 2 ranks of one group recomputing each layer, their
    all-to-all bytes the analytic count; the adapter holds one LoRA pair per expert stack (rank x
    experts rows), plain peft loads it on the saved base, and the export merges it (the experts'
    adapters into their stacks) into a model plain transformers loads with the same logits."""
    assert set(MOE_STRATEGIES) == {
        *("ddp", "zero1", "fsdp", "zero2", "hsdp", "fsdp+ep", "tp", "tp-sp", "fsdp+tp"),
        *("pp", "ddp+pp", "fsdp+pp", "fsdp+tp+pp", "cp", "fsdp+cp", "hsdp+tp"),
    }
    weights = adapter(reference)
    experts = {k: v for k, v in weights.items() if ".mlp.experts." in k}
    assert len(experts) == 4 * 4  # 4 layers x (gate_up, down) x (lora_A, lora_B)
    assert all(16 * 8 in v.shape for v in experts.values())  # r = 16 for each of the 8 experts
    assert all(v.abs().sum() > 0 for k, v in experts.items() if "lora_B" in k)  # trained
    sharded = ["--strategy", "fsdp+ep", "--nproc", "4", "parallel.ep=2", "parallel.shard_experts=true"]
    distft("train", *MOE, *sharded, "--out", str(tmp_path / "fsdp+ep"))
    # tp, and fsdp+ep in one expert group of 2 recomputing each layer (the recompute runs the
    # forward's all-to-alls again), in one launch.
    recomputed = tmp_path / "fsdp+ep-checkpointed"
    layout = ["--strategy", "fsdp+ep", "--nproc", "2", "model.activation_checkpointing=full"]
    pair = {"tp": ["--strategy", "tp", "--nproc", "2"], recomputed.name: layout}
    trained({name: [*MOE, *args, "--out", str(tmp_path / name)] for name, args in pair.items()}, 2, tmp_path)
    for run in (tmp_path / "tp", tmp_path / "fsdp+ep", recomputed):
        assert_same_training(run, reference)
        assert_planned_bytes(run)
    assert_tp_bytes(tmp_path / "tp", micro_batches=4)  # the planner's count of the experts' all-reduces
    assert_all_to_all_bytes(tmp_path / "fsdp+ep", micro_batches=1)
    assert expert_groups(tmp_path / "fsdp+ep") == {
        "replicate": [[0, 2], [1, 3]] * 2,
        "ep": [[0, 1]] * 2 + [[2, 3]] * 2,
    }
    assert_all_to_all_bytes(recomputed, micro_batches=2, forwards=2)

    model = AutoModelForCausalLM.from_pretrained(reference / "base")
    plain = PeftModel.from_pretrained(model, reference / "adapter").eval()
    ids = torch.randint(0, 4000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = plain(input_ids=ids).logits
        with plain.disable_adapter():
            base = plain(input_ids=ids).logits
    assert not torch.allclose(adapted, base)  # the adapter (experts included) changes the model
    # Merged into its base, a model plain transformers loads; llama.cpp's format is refused.
    merged = tmp_path / "merged"
    assert main(["export", "--run", str(reference), "--out", str(merged), "--dtype", "float32"]) == 0
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(merged).eval()(input_ids=ids).logits
    torch.testing.assert_close(exported, adapted, rtol=1e-4, atol=1e-4)
    assert (
        main(["export", "--run", str(reference), "--format", "gguf", "--out", str(tmp_path / "m.gguf")]) == 2
    )


def test_dpo_under_expert_context_and_sequence_parallelism_trains_as_one_process(tmp_path):
    """DPO on the bundled pairs, padded (each pair's answers of their own lengths), its reference the
    base under the disabled adapters in every step's forward: under fsdp+ep (each rank's experts
    without their LoRA deltas), cp (each rank half of every row's tokens, the padding and the
    fill that evens the halves left out of the routers' pooled sums, which one all-reduce adds up)
    and tp-sp (each rank routes its sequence shard, the routers' sums pooled as cp pools them),
    the losses, rewards, auxiliary loss and adapter of one process."""
    flags = [*MOE, "--objective", "dpo", "--data", "sample-pairs", "data.max_rows=12", "train.max_steps=2"]
    flags += [
        "data.packing=false",
        "data.max_length=1202",
    ]  # whole rows, padded; 1202: not 2 x 2 whole chunks
    single = tmp_path / "single"
    assert main(["train", *flags, "--out", str(single)]) == 0
    strategies = ("fsdp+ep", "cp", "tp-sp")
    cases = {s: [*flags, "--strategy", s, "--nproc", "2", "--out", str(tmp_path / s)] for s in strategies}
    trained(cases, 2, tmp_path / "logs")  # one launch
    for strategy in strategies:
        run = tmp_path / strategy
        # cp sums each answer's log-probability over its sequence shards, fsdp+ep each token's
        # experts in another order, and DPO weighs each token's gradient by its pair's sigmoid
        # (tests/parallel/test_preference.py): one tensor of the adapter is up to 5e-5 of its norm
        # away after 2 steps (fsdp+ep, layer 2's q_proj lora_B).
        assert_same_training(run, single, rtol=1e-4)
        for got, want in zip(metrics(run), metrics(single), strict=True):
            for name in ("rewards_chosen", "rewards_rejected", "margin", "router_aux_loss"):
                # differences of log-probabilities near -100: rounding of 1e-7 relative is 1e-5 absolute
                assert got[name] == pytest.approx(want[name], rel=1e-4, abs=1e-5), (
                    strategy,
                    got["step"],
                    name,
                )
    assert metrics(single)[-1]["margin"] != 0  # the policy moved from its reference


def test_the_router_trains_beside_the_adapters_on_request(tmp_path):
    """lora.modules_to_save=["gate"]: each layer's router trains in full beside the adapters, saved
    with them; under tp-sp, each rank routing its sequence shard, its gradient is summed over the
    shards and it trains as one process. With the (tied) lm_head's copy training too, the first
    layer's input needs a gradient: the bytes are the planner's."""
    flags = [*MOE, 'lora.modules_to_save=["gate","lm_head"]', "train.max_steps=2"]
    single, tp_sp = tmp_path / "single", tmp_path / "tp-sp"
    assert main(["train", *flags, "--out", str(single)]) == 0
    distft("train", *flags, "--strategy", "tp-sp", "--nproc", "2", "--out", str(tp_sp))
    assert_same_training(tp_sp, single)
    assert_planned_bytes(tp_sp)
    routers = {k: v for k, v in adapter(single).items() if k.endswith("mlp.gate.weight")}
    base = AutoModelForCausalLM.from_pretrained(single / "base")
    assert len(routers) == 4
    for layer in range(4):
        saved = routers[f"base_model.model.model.layers.{layer}.mlp.gate.weight"]
        assert not torch.equal(saved, base.model.layers[layer].mlp.gate.weight)  # trained


# Full finetuning with the router's auxiliary losses. Only the runs a resume starts from (step 1's
# checkpoint, and the sharded resume's of step 2) checkpoint, every step.
FULL = [*MOE, "--method", "full", "train.eval_every=3", "output.save_base=false"]
AUX = ["moe.aux_loss_coef=0.05", "moe.z_loss_coef=0.01"]
CHECKPOINTED = ["output.checkpoint_every=1", "output.keep_last=3"]
# tp-sp without sequence parallelism: every rank routes every position, the router's gradient
# complete on each (its sequence-parallel form resumes below); each layer recomputed.
FULL_LAYOUTS = {
    "fsdp": [],
    "fsdp+ep": CHECKPOINTED,
    "tp": [],
    "tp-sp": ["parallel.sequence_parallel=false", "model.activation_checkpointing=full", *CHECKPOINTED],
    "pp": ["parallel.schedule=interleaved-1f1b", "parallel.stages_per_rank=2"],
    "fsdp+cp": [],
}
EP_GROUPS = ["--strategy", "fsdp+ep", "--nproc", "4", "parallel.ep=2"]
RESUMED_INTO = {
    "fsdp+tp+pp": ["--strategy", "fsdp+tp+pp", "--nproc", "4", "parallel.tp=2", "parallel.pp=2"],
    "replicated": EP_GROUPS,
    "sharded": [*EP_GROUPS, "parallel.shard_experts=true"],
    "tp-sp": [
        *("--strategy", "tp-sp", "--nproc", "2"),
        *("parallel.sequence_parallel=true", "model.activation_checkpointing=none"),
    ],
}
# (source, target). The sharded groups first in their launch: FSDP2 across the groups refuses the
# expert mesh built for a case before it in the same processes ("different mesh objects").
RESUMES = [("tp-sp", "sharded"), ("tp-sp", "replicated"), ("fsdp+ep", "fsdp+tp+pp"), ("fsdp+ep", "tp-sp")]


def train_full_runs(tmp_path, single) -> None:
    """Each strategy of FULL_LAYOUTS on 2 ranks (one launch) agrees with one process at every step."""
    cases = {
        s: [*FULL, *AUX, *layout, "--strategy", s, "--nproc", "2", "--out", str(tmp_path / s)]
        for s, layout in FULL_LAYOUTS.items()
    }
    trained(cases, 2, tmp_path / "logs-full")
    routing = ("router_aux_loss", "router_z_loss", "expert_imbalance")
    for strategy in FULL_LAYOUTS:
        run = tmp_path / strategy
        assert_planned_bytes(run)
        for got, want in zip(metrics(run), metrics(single), strict=True):
            for name in ("loss", "grad_norm", "eval_loss", *routing):
                if name in want:
                    assert got[name] == pytest.approx(want[name], rel=1e-5), (strategy, got["step"], name)
            assert got["expert_tokens"] == want["expert_tokens"] and len(want["expert_tokens"]) == 8
            assert want["router_aux_loss"] >= 2 - 1e-6  # top-2 routing: 2 when balanced, more when not
    assert_all_to_all_bytes(tmp_path / "fsdp+ep", micro_batches=2)


def resume_across_degrees(tmp_path, single) -> None:
    """Each of RESUMES from its source's step 1, and the bf16 run over fp32 masters, in one launch
    per world size: steps 2 and 3 as one process trains them, the bytes planned for the target."""
    outs = {f"{s}-{t}": crashed_copy(tmp_path / s, tmp_path / f"resumed-{s}-{t}", 1) for s, t in RESUMES}
    cases = {f"{s}-{t}": ["--resume", str(outs[f"{s}-{t}"]), *RESUMED_INTO[t]] for s, t in RESUMES}
    # bf16 weights over fp32 masters, replicated: the experts compute in bf16 as FSDP's gathered
    # copies do (the all-to-alls' rows bf16 both ways), the replicas all-reduce fp32 gradients.
    bf16 = ["model.dtype=bfloat16", "train.master_weights=fp32", "train.max_steps=1"]
    cases["masters"] = [*FULL, *bf16, *EP_GROUPS, "--out", str(tmp_path / "masters")]
    said = {}
    for world in ("2", "4"):
        names = [name for name, args in cases.items() if args[args.index("--nproc") + 1] == world]
        batch = trained({name: cases[name] for name in names}, int(world), tmp_path / f"logs-{world}")
        said |= {name: batch.output(name) for name in names}
    groups_said = {"replicated": " (ep=2, replicas=2)", "sharded": " (ep=2, experts sharded over 2)"}
    for source, target in RESUMES:
        out = outs[f"{source}-{target}"]
        assert "(step 1)" in said[f"{source}-{target}"]
        for got, want in zip(metrics(out), metrics(single), strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (out.name, got["step"])
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), (out.name, got["step"])
        ranks = json.loads((out / "ranks.json").read_text())  # the resumed run's, from its step 2
        label = SPECS[RESUMED_INTO[target][1]].label + groups_said.get(target, "")
        assert ranks[0]["predicted_by"].startswith(label), ranks[0]["predicted_by"]
        assert_planned_bytes(out)


def test_full_finetuning_trains_experts_and_router_as_one_process(tmp_path):
    """--method full, with the router's load-balancing loss and z-loss: every expert, the router
    and attention train; fsdp, fsdp+ep (the experts' stacks and their optimizer state sharded
    along the experts), tp (along their intermediate dimension, the router's gradient complete
    on every rank), tp-sp (the same, its collectives hand-written), pp (interleaved: 4 stages of
    one layer on 2 ranks, the losses pooled over the layers of every stage from the sums each
    passes on) and fsdp+cp (the losses pooled over every rank's tokens, the stacks sharded by
    FSDP) agree with one process at every step in loss, gradient norm, the auxiliary losses and
    the tokens each expert took, and in the evaluation loss after; checkpoints resume across
    expert-parallel degrees, into fsdp+tp+pp (full finetuning under TP x PP, every expert's half
    sharded by FSDP2), into tp-sp's sequence-parallel form, and from tp-sp into fsdp+ep's two
    expert groups of 2, each group's stacks replicated (their gradients all-reduced across the
    groups) or FSDP-sharded across them (gathered and reduce-scattered there), the bytes planned by
    mesh dimension and what each rank holds to the byte; one process resumes the sharded run's own
    checkpoint. The auxiliary losses move the gradient, not the loss recorded."""
    single, plain = tmp_path / "single", tmp_path / "plain"
    assert main(["train", *FULL, *AUX, "--out", str(single)]) == 0
    train_full_runs(tmp_path, single)
    assert main(["train", *FULL, "moe.aux_loss_coef=0", "train.max_steps=1", "--out", str(plain)]) == 0
    first, with_aux = metrics(plain)[0], metrics(single)[0]
    assert first["loss"] == with_aux["loss"] and first["grad_norm"] != with_aux["grad_norm"]
    assert first["router_aux_loss"] == pytest.approx(with_aux["router_aux_loss"], rel=1e-6)
    trained_model = AutoModelForCausalLM.from_pretrained(single / "model")
    start = AutoModelForCausalLM.from_config(PRESETS["qwen3-moe-micro"].to_config())
    layer, before = trained_model.model.layers[0].mlp, start.model.layers[0].mlp
    assert trained_model.config.model_type == "qwen3_moe"  # the export plain transformers loads
    assert not torch.equal(layer.experts.down_proj, before.experts.down_proj)
    assert not torch.equal(layer.gate.weight, before.gate.weight)
    for strategy in ("fsdp+ep", "tp", "tp-sp", "pp"):  # the experts gathered whole again
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / strategy / "model").state_dict()
        for name, weight in trained_model.state_dict().items():
            torch.testing.assert_close(exported[name], weight, rtol=1e-4, atol=1e-6, msg=(strategy, name))

    # Across degrees, each way: fsdp+ep's checkpoint (each rank's experts) resumed by fsdp+tp+pp
    # (2 stages of 2 TP ranks, each expert's half cut from the whole and sharded by FSDP2) and by
    # tp-sp with sequence parallelism (each rank routing its shard, the router's gradient summed
    # over the shards), tp-sp's (its projections' slices as DTensors, every expert's half written
    # whole) by fsdp+ep on 4 ranks in 2 expert groups, their experts replicated or sharded across
    # the groups; each trains steps 2 and 3 as one process does,
    # moving the bytes the planner predicted for it, and fsdp+tp+pp writes its checkpoints (its
    # shards gathered whole) on the way.
    resume_across_degrees(tmp_path, single)
    # Every layer's 4 experts of a rank, both stacks (gate/up 48 x 32, down 32 x 24), in fp32:
    # replicas all-reduce their gradients; sharded, they are gathered forward and again backward,
    # their gradients reduce-scattered.
    stacks = 4 * 4 * (48 * 32 + 32 * 24) * 4
    across_groups = {
        "replicated": {"all_reduce": stacks},
        "sharded": {"all_gather": 2 * stacks, "reduce_scatter": stacks},
    }
    plan = ["plan", "--model", "qwen3-moe-micro", "--method", "full", "--precision", "fp32", "--gpu", "h100"]
    req = make_request(build_parser().parse_args(plan))
    for target, moved in across_groups.items():
        run = tmp_path / f"resumed-tp-sp-{target}"
        assert metrics(run)[1]["comm_bytes_by_dim"]["replicate"] == moved
        lay = Parallelism.at("fsdp+ep", dp=4, ep=2, shard_experts=target == "sharded")
        for r in json.loads((run / "ranks.json").read_text()):  # sharded: 2 of each rank's 4 experts
            held = state_bytes(req.model, req.training, lay, dp_rank=r["rank"])
            assert (held.params, held.grads, held.optimizer) == (
                r["param_bytes"]["dense"],
                r["grad_bytes"],
                r["optimizer_bytes"],
            ), (target, r["rank"])
    masters = tmp_path / "masters"  # trained beside the resumes on 4 ranks
    assert_planned_bytes(masters)
    assert metrics(masters)[0]["comm_bytes_by_dim"]["replicate"] == {"all_reduce": stacks}
    sharded = tmp_path / "resumed-tp-sp-sharded"
    # Its checkpoint of step 2 (FSDP2's strided shards of the experts) resumed by one process.
    out = crashed_copy(sharded, tmp_path / "resumed-sharded-single", 2)
    proc = distft("train", "--resume", str(out), "--strategy", "single", "--nproc", "1")
    assert "parallel.shard_experts=true reset to false" in proc.stdout
    for got, want in zip(metrics(out), metrics(single), strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (out.name, got["step"])


def test_the_planner_counts_every_expert_and_walks_to_expert_parallelism(capsys):
    """`distft plan` on Qwen3-30B-A3B: every expert in memory, a token's 8 in FLOPs; full finetuning
    on 8 H100s, where FSDP gathers each layer's 128 experts every micro-batch and does not fit,
    takes the tree to FSDP x EP, on two nodes with an expert group per node; QLoRA, whose NF4 base
    leaves the fused stacks out, is refused."""
    assert (
        main(["plan", "--model", "Qwen/Qwen3-30B-A3B", "--gpu", "h100", "--gpus", "8", "--method", "full"])
        == 0
    )
    out = " ".join(capsys.readouterr().out.split())
    assert "30.53B parameters" in out and "128 experts of 768 (8 per token: 3.35B parameters active)" in out
    assert "3a. Do the experts need sharding? Yes" in out and "--strategy fsdp+ep --nproc 8" in out
    assert main(["plan", "--model", "qwen3-30b-a3b", "--gpu", "h100", "--method", "qlora"]) == 2
    err = capsys.readouterr().err
    assert "fused parameter stacks" in err and len(err.strip().splitlines()) == 1, err
    # The all-to-alls: 2048 tokens x 8 experts x hidden 2048 in bf16, there and back, forward and
    # backward, in each of the 48 layers; 128 int64 counts per layer. An uneven router slows the
    # busiest rank and fills it: its routed rows grow, the bytes it sends do not.
    flags = "--model qwen3-30b-a3b --gpu h100 --gpus 8 --method full"
    plans = [
        evaluate(make_request(build_parser().parse_args(["plan", *flags.split(), "--expert-imbalance", i])))[
            "fsdp+ep"
        ]
        for i in ("1", "1.5")
    ]
    even, uneven = plans
    assert bytes_by_kind(even.collectives)["all_to_all"] == 2048 * 8 * 2048 * 2 * 2 * 2 * 48 + 128 * 8 * 48
    assert bytes_by_kind(uneven.collectives) == bytes_by_kind(even.collectives)
    assert uneven.activations > even.activations and uneven.step_s > even.step_s
    # Two nodes of 8: expert groups of a node's 8 GPUs keep the all-to-alls off the slower link
    # between nodes, for an all-reduce of every rank's 16 experts' gradients (bf16) across the 2.
    assert main(["plan", *flags.split(), "--nodes", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "FSDP x EP (ep=8, replicas=2) keeps 16 experts whole per GPU" in out and " parallel.ep=8 " in out
    request = make_request(build_parser().parse_args(["plan", *flags.split(), "--nodes", "2"]))
    groups = bytes_by_dim(evaluate(request)["fsdp+ep"].collectives)
    assert groups["replicate"] == {"all_reduce": 128 * 3 * 768 * 2048 * 48 // 8 * 2}
    assert groups["ep"]["all_to_all"] == bytes_by_kind(even.collectives)["all_to_all"]
    # Micro-batches of 2: a whole copy of a group's experts in each no longer fits; FSDP2 sharding
    # them across the 2 groups does (gathered forward and again backward, reduce-scattered, bf16).
    assert main(["plan", *flags.split(), "--nodes", "2", "--micro-batch", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "(ep=8, experts sharded over 2) keeps 16 experts per GPU, FSDP-sharded across the 2 expert groups"
        in out
    )
    assert " parallel.ep=8 parallel.shard_experts=true " in out
    request = make_request(
        build_parser().parse_args(["plan", *flags.split(), "--nodes", "2", "--micro-batch", "2"])
    )
    sharded = bytes_by_dim(evaluate(request)["fsdp+ep"].collectives)["replicate"]
    assert sharded == {
        "all_gather": 2 * 128 * 3 * 768 * 2048 * 48 // 8 * 2,
        "reduce_scatter": 128 * 3 * 768 * 2048 * 48 // 8 * 2,
    }
    assert [name for name, family in FAMILIES.items() if family.moe] == ["qwen3_moe"]  # each one tested here


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--method", "qlora"], "its NF4 base quantizes Linear layers"),
        (['lora.target_modules=["q_proj","gate_proj"]'], "names gate_proj but not up_proj"),
        (["lora.dropout=0.1"], "lora.dropout cannot apply to qwen3-moe-micro's experts"),
        (
            ["--strategy", "fsdp+ep", "--nproc", "3", "train.global_batch_size=6"],
            "use a process count that divides 8",
        ),
        (["--strategy", "fsdp+ep", "--nproc", "2", "--model", "micro"], "and micro has none"),
        (
            ["--strategy", "fsdp+ep", "--nproc", "6", "parallel.ep=3", "train.global_batch_size=6"],
            "each of the 3 ranks of an expert group an equal share of qwen3-moe-micro's 8 experts: use a parallel.ep",
        ),
        (
            ["--strategy", "fsdp+ep", "--nproc", "4", "parallel.ep=3"],
            "parallel.ep=3 must divide the 4 processes",
        ),
        (
            ["--strategy", "fsdp+ep", "--nproc", "2", "parallel.shard_experts=true"],
            "with parallel.ep=2 (every process) there is one group",
        ),
        (
            ["--strategy", "fsdp", "--nproc", "2", "parallel.shard_experts=true"],
            "parallel.shard_experts sets the experts' layout of --strategy fsdp+ep",
        ),
        (
            ["--strategy", "fsdp+ep", "--nproc", "2", "parallel.ep=1"],
            "use --strategy fsdp, or parallel.ep of 2",
        ),
        (
            ["--strategy", "fsdp", "--nproc", "2", "parallel.ep=2"],
            "parallel.ep sets the expert groups of --strategy fsdp+ep",
        ),
    ],
    ids=[
        "qlora",
        "gate-without-up",
        "dropout",
        "ep-uneven",
        "ep-dense",
        "ep-group-uneven",
        "ep-groups",
        "shard-experts-one-group",
        "shard-experts-not-ep",
        "ep-1",
        "ep-not-ep",
    ],
)
def test_what_cannot_run_an_moe_is_refused_before_launch(flags, says, tmp_path, capsys):
    assert main(["train", *MOE, *flags, "--out", str(tmp_path / "x")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "warning:" not in line]  # --nproc 3
    assert len(err) == 1 and says in err[0], err
    assert not (tmp_path / "x").exists()


def test_a_strategy_not_taught_an_moe_is_refused_and_planned_as_such(monkeypatch, tmp_path, capsys):
    """Every strategy runs an MoE today; one whose spec does not run "moe" (a new one, until it
    is taught) is refused before launch in one line naming those that do, and the planner lists
    it as not applicable, saying why."""
    untaught = dataclasses.replace(SPECS["tp"], capabilities={**SPECS["tp"].capabilities, "moe": "not yet"})
    monkeypatch.setitem(SPECS, "tp", untaught)
    assert main(["train", *MOE, "--strategy", "tp", "--nproc", "2", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "which --strategy tp has not been taught to split" in err[0], err
    assert "tp-sp" in err[0] and not (tmp_path / "x").exists()
    assert main(["plan", "--model", "qwen3-moe-micro", "--gpu", "h100", "--gpus", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps the line
    assert "TP (does not split a mixture of experts yet)" in out


def test_a_tp_degree_that_does_not_split_the_experts_is_refused(tmp_path, capsys):
    """tp cuts every expert's intermediate dimension in N: a degree that does not divide
    moe_intermediate_size is refused before launch, in one line (heads and KV heads divide here)."""
    config = PRESETS["qwen3-moe-micro"].to_config()
    config.moe_intermediate_size = 25
    config.save_pretrained(tmp_path / "odd")
    flags = ["--model", str(tmp_path / "odd"), "--strategy", "tp", "--nproc", "2"]
    assert main(["train", *MOE, *flags, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "moe_intermediate_size 25 is not divisible by 2" in err[0], err
    assert not (tmp_path / "x").exists()
