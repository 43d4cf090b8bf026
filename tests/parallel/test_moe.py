"""Qwen3-MoE (`qwen3-moe-micro`: 8 experts, each token routed to 2) under every strategy that takes
a mixture of experts, against one process on the same global batch: LoRA on attention and on every
expert (peft's parameter adapters on the fused stacks), and full finetuning, which trains the
experts and the router. The adapter is an ordinary PEFT adapter that plain peft loads; what cannot
run an MoE is refused before launch, in one line."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from distft.cli import main
from distft.model import PRESETS
from distft.model.families import FAMILIES
from distft.parallel.registry import STRATEGIES
from tests.helpers import PARITY, adapter, assert_same_training, distft, metrics

MOE = [*(a if a != "micro" else "qwen3-moe-micro" for a in PARITY), "data.max_rows=16"]
MOE_STRATEGIES = [name for name, cls in STRATEGIES.items() if cls.supports_moe and name != "single"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "single"
    assert main(["train", *MOE, "--out", str(out)]) == 0
    return out


def test_lora_on_attention_and_every_expert_trains_as_one_process(reference, tmp_path):
    """ddp, zero1, fsdp and zero2 (FSDP2 shards each layer's expert stacks along the experts): the
    same losses, gradient norms and adapter; the adapter holds one LoRA pair per expert stack (rank
    x experts rows); plain peft loads it on the saved base, and the export merges it (the experts'
    adapters into their stacks) into a model plain transformers loads with the same logits."""
    assert set(MOE_STRATEGIES) == {"ddp", "zero1", "fsdp", "zero2"}
    weights = adapter(reference)
    experts = {k: v for k, v in weights.items() if ".mlp.experts." in k}
    assert len(experts) == 4 * 4  # 4 layers x (gate_up, down) x (lora_A, lora_B)
    assert all(16 * 8 in v.shape for v in experts.values())  # r = 16 for each of the 8 experts
    assert all(v.abs().sum() > 0 for k, v in experts.items() if "lora_B" in k)  # trained
    for strategy in MOE_STRATEGIES:
        run = tmp_path / strategy
        distft("train", *MOE, "--strategy", strategy, "--nproc", "2", "--out", str(run))
        assert_same_training(run, reference)

    model = AutoModelForCausalLM.from_pretrained(reference / "base")
    plain = PeftModel.from_pretrained(model, reference / "adapter").eval()
    ids = torch.randint(0, 5000, (2, 24), generator=torch.Generator().manual_seed(0))
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


def test_full_finetuning_trains_experts_and_router_as_one_process(tmp_path):
    """--method full: every expert, the router and attention train; fsdp shards them and agrees
    with one process in loss and gradient norm at every step, and in the evaluation loss after."""
    full = [*MOE, "--method", "full", "train.eval_every=3", "output.save_base=false"]
    single, fsdp = tmp_path / "single", tmp_path / "fsdp"
    assert main(["train", *full, "--out", str(single)]) == 0
    distft("train", *full, "--strategy", "fsdp", "--nproc", "2", "--out", str(fsdp))
    for got, want in zip(metrics(fsdp), metrics(single), strict=True):
        for name in ("loss", "grad_norm", "eval_loss"):
            if name in want:
                assert got[name] == pytest.approx(want[name], rel=1e-5), (got["step"], name)
    trained = AutoModelForCausalLM.from_pretrained(single / "model")
    start = AutoModelForCausalLM.from_config(PRESETS["qwen3-moe-micro"].to_config())
    layer, before = trained.model.layers[0].mlp, start.model.layers[0].mlp
    assert trained.config.model_type == "qwen3_moe"  # the export plain transformers loads
    assert not torch.equal(layer.experts.down_proj, before.experts.down_proj)
    assert not torch.equal(layer.gate.weight, before.gate.weight)


def test_the_planner_says_it_does_not_count_experts(capsys):
    """`distft plan` on an MoE: one line, no traceback (a run's own prediction is then none)."""
    assert main(["plan", "--model", "qwen3-moe-micro", "--gpu", "h100"]) == 2
    err = capsys.readouterr().err
    assert "whose experts the planner does not count yet" in err and len(err.strip().splitlines()) == 1, err
    assert [name for name, family in FAMILIES.items() if family.moe] == ["qwen3_moe"]  # each one tested here


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--strategy", "tp", "--nproc", "2"], "cannot split yet (its plans know dense MLPs only)"),
        (["--method", "qlora"], "its NF4 base quantizes Linear layers"),
        (['lora.target_modules=["q_proj","gate_proj"]'], "names gate_proj but not up_proj"),
        (["lora.dropout=0.1"], "lora.dropout cannot apply to qwen3-moe-micro's experts"),
    ],
    ids=["tp", "qlora", "gate-without-up", "dropout"],
)
def test_what_cannot_run_an_moe_is_refused_before_launch(flags, says, tmp_path, capsys):
    assert main(["train", *MOE, *flags, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()
