"""QLoRA (`--method qlora`, NF4 base from torchao): storage layout, refusals, and parity of single,
DDP, FSDP and ZeRO-2 on 2 gloo processes with one process on the same global batch.

The NF4 base is quantized from the same seeded weights on every rank, bit for bit, and FSDP2
gathers the very same codes and scales, so the tolerance is LoRA's (1e-5 relative): quantization
changes the model, not its agreement across strategies.
"""

import json

import pytest
import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file

from distft.cli import main
from distft.config import load_config
from distft.infer import load_trained
from distft.model import apply_method, load_base_model, model_config
from distft.model.nf4 import (
    NF4Spec,
    is_nf4,
    nf4_bytes,
    projection_shapes,
    quantize,
    storage_layout,
)
from tests.helpers import PARITY, assert_same_training, crashed_copy, distft, metrics


def quantized_bytes(model: torch.nn.Module) -> int:
    """This rank's NF4 bytes: codes, block scales, group factors, per-tensor mean and code book."""
    return sum(v for k, v in storage_layout(model).items() if k != "dense")


# micro's k_proj holds 8 NF4 blocks: groups of 4 give each of 2 FSDP ranks a whole group.
QLORA = [*PARITY, "train.max_steps=2", "--method", "qlora", "model.quant_scaler_block_size=4"]


# ---- storage layout -------------------------------------------------------------------------


@pytest.mark.parametrize("double_quant", [True, False])
def test_nf4_storage_layout_matches_the_formula(double_quant):
    spec = NF4Spec(64, 256, double_quant)
    weight = (
        torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) * 0.05
    )  # 1,024 blocks of 64: 4 groups of 256
    q = torch.nn.Parameter(quantize(weight, spec), requires_grad=False)
    layout = storage_layout(torch.nn.ParameterList([q]))
    assert {k: v for k, v in layout.items() if k != "dense"} == nf4_bytes(weight.numel(), spec)
    if double_quant:  # the planner's model: 0.5 + 1/64 + 4/(64 x 256) bytes per weight, + 17 fp32
        assert quantized_bytes(torch.nn.ParameterList([q])) == 65536 * 0.5 + 1024 + 4 * 4 + 17 * 4
    else:  # fp32 absmax per block (and a unit factor per group: torchao's container)
        assert layout["quantized_scalers"] == 1024 * 4
    # Dequantized error: NF4's 16 levels over [-absmax, absmax], about 10% of the std.
    error = (q.get_original_weight() - weight).pow(2).mean().sqrt() / weight.std()
    assert 0.02 < error < 0.15


def test_single_quantization_keeps_exact_block_scales():
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    exact = quantize(weight, NF4Spec(64, 4, double_quant=False)).get_original_weight()
    double = quantize(weight, NF4Spec(64, 4, double_quant=True)).get_original_weight()
    # Each block's largest weight is NF4's code +-1 times its absmax: exact without double quant.
    blocks = weight.flatten().view(-1, 64)
    idx = blocks.abs().argmax(dim=1, keepdim=True)
    torch.testing.assert_close(exact.flatten().view(-1, 64).gather(1, idx), blocks.gather(1, idx))
    # Double quantization stores the absmaxes in 8 bits: the weights move, by a fraction of a code
    # step, and the mean error barely changes (a max-error comparison is noise either way).
    assert 0 < (double - exact).abs().max() < 0.05
    assert (double - weight).abs().mean() <= (exact - weight).abs().mean() * 1.01


def test_qlora_model_quantizes_every_decoder_projection():
    cfg = load_config(None, ["model.name=micro", "train.method=qlora", "model.quant_scaler_block_size=4"])
    lm = apply_method(load_base_model(cfg.model), cfg)
    quantized = [n for n, p in lm.named_parameters() if is_nf4(p)]
    assert len(quantized) == 4 * 7 and all(".base_layer.weight" in n for n in quantized)
    trainable = [n for n, p in lm.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    spec = NF4Spec.from_config(cfg.model)
    formula = sum(
        nf4_bytes(r * c, spec)[k]
        for r, c in projection_shapes(lm.config).values()
        for k in nf4_bytes(1024, spec)
    )
    assert quantized_bytes(lm) == 4 * formula


# ---- refused before launch ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--strategy", "tp", "--nproc", "2"], "splits only along dim 0"),
        (["--strategy", "tp-sp", "--nproc", "2"], "splits only along dim 0"),
        (["--strategy", "fsdp+tp", "--nproc", "4", "parallel.tp=2"], "splits only along dim 0"),
        # tiny's k_proj: 32 blocks in 8 groups of 4 (the default, `NF4Spec.group_size`): 16 ranks
        # cannot split a group; groups of 2 can.
        (
            [
                "--model",
                "tiny",
                "--strategy",
                "fsdp",
                "--nproc",
                "16",
                "train.global_batch_size=16",
                "train.micro_batch_size=1",
            ],
            "model.quant_scaler_block_size=2",
        ),
        (
            ["--strategy", "fsdp", "--nproc", "2", "model.quant_block_size=96"],
            "does not split into NF4 blocks",
        ),
        (["--strategy", "fsdp", "--nproc", "1"], "use --strategy single"),
    ],
)
def test_refused_before_launch(args, expected, capsys, tmp_path):
    assert main(["train", "--model", "micro", "--method", "qlora", *args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert not (tmp_path / "config.toml").exists()  # nothing ran


# ---- parity: 2 processes vs 1 ----------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("qlora-single")
    distft("train", *QLORA, "--out", str(out))
    return out


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("qlora-fsdp")
    distft(
        "train", "--strategy", "fsdp", "--nproc", "2", *QLORA, "--checkpoint-every", "1", "--out", str(out)
    )
    return out


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_matches_single_process(strategy, reference, tmp_path):
    out = tmp_path / strategy
    distft("train", "--strategy", strategy, "--nproc", "2", *QLORA, "--out", str(out))
    assert_same_training(out, reference)
    first = metrics(out)[0]
    assert first["comm_bytes"] == first["comm_bytes_expected"]


def test_fsdp_matches_single_process_and_shards_the_4bit_base(fsdp_run, reference):
    assert_same_training(fsdp_run, reference)
    first = metrics(fsdp_run)[0]
    # All-gathers carry the NF4 codes, block scales and group factors (`quant.nf4_gather_bytes`).
    assert first["comm_bytes"] == first["comm_bytes_expected"]

    # Each rank stores half of every NF4 inner tensor plus the per-tensor mean and code book; the
    # dense rest (embeddings, norms, adapters) is half of what LoRA's ranks hold of it.
    config = model_config("micro")
    spec = NF4Spec(64, 4, True)
    shapes = projection_shapes(config).values()
    nf4 = {
        k: config.num_hidden_layers * sum(nf4_bytes(r * c, spec, 4, shards=2)[k] for r, c in shapes)
        for k in nf4_bytes(64, spec)
    }
    cfg = load_config(None, ["model.name=micro"])
    torch.manual_seed(0)
    lora_total = sum(p.numel() * 4 for p in apply_method(load_base_model(cfg.model), cfg).parameters())
    projections = config.num_hidden_layers * sum(r * c for r, c in shapes) * 4
    for rank in json.loads((fsdp_run / "ranks.json").read_text()):
        layout = rank["param_bytes"]
        assert {k: layout[k] for k in nf4} == nf4
        assert layout["dense"] == (lora_total - projections) // 2
        assert sum(layout.values()) < lora_total // 2


def test_checkpoint_holds_adapters_only_and_resumes_in_one_process(fsdp_run, reference, tmp_path):
    """The NF4 base is rebuilt from the model source on resume, never saved (DCP could not load it
    back: it narrows tensors, which NF4Tensor refuses). A 2-rank FSDP checkpoint resumes in one
    process (FSDP over one rank is refused with QLoRA: `single` it is) and trains the same."""

    from torch.distributed.checkpoint import FileSystemReader

    run = crashed_copy(fsdp_run, tmp_path / "resumed", 1)
    checkpoint = run / "checkpoints" / "step-000001"
    keys = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)
    proc = distft("train", "--resume", str(run), "--strategy", "single", "--nproc", "1")
    assert "resuming from" in proc.stdout and "step 1" in proc.stdout
    assert_same_training(run, reference)


def test_adapter_loads_on_the_dequantized_base(fsdp_run, capsys):
    """`distft infer --run` rebuilds the NF4 base (dequantized) and loads the PEFT adapter on it:
    the logits equal those of the training-time model (NF4 weights + the same adapter)."""
    assert json.loads((fsdp_run / "adapter" / "quantization.json").read_text())["scaler_block_size"] == 4
    loaded = load_trained(run=str(fsdp_run))
    assert not any(is_nf4(p) for p in loaded.model.parameters())  # plain weights: no torchao needed

    cfg = load_config(fsdp_run / "config.toml")
    cfg.model.name = str(fsdp_run / "base")
    trained = apply_method(load_base_model(cfg.model), cfg)
    state = load_file(fsdp_run / "adapter" / "adapter_model.safetensors")
    assert not set_peft_model_state_dict(trained, state).unexpected_keys
    ids = torch.randint(0, 4000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained.eval()(input_ids=ids).logits
        got = loaded.model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad(), loaded.model.disable_adapter():  # the adapter did move the model
        assert not torch.allclose(loaded.model(input_ids=ids).logits, want, atol=1e-3)

    assert main(["infer", "--run", str(fsdp_run), "--max-new-tokens", "4"]) == 0
    assert "generated summary" in capsys.readouterr().out
