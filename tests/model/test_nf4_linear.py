"""QLoRA's NF4 projections (`distft.model.nf4_linear`): the eager path is torchao's bit for bit,
the compiled dequantisation gives the same outputs and gradients, it is picked on CUDA by
`model.compile`, and a QLoRA decoder layer traces whole under torch.compile (no graph break)."""

import pytest
import torch
import torch.nn.functional as F

from distft.config import load_config
from distft.model import apply_method, causal_lm, load_base_model
from distft.model.nf4 import NF4Spec, dequantize_base, is_nf4, quantize
from distft.model.nf4_linear import (
    NF4Linear,
    dequantize,
    dequantize_compiled_wanted,
    use_compiled_dequantize,
)


def nf4_weight(dtype: torch.dtype, double_quant: bool = True, shape=(96, 64)) -> torch.Tensor:
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 0.05
    return quantize(w.to(dtype), NF4Spec(64, 256, double_quant))


def qlora_micro(compile_setting: str = "false"):
    cfg = load_config(
        None, ["model.name=micro", "lora.rank=4", "train.method=qlora", f"model.compile={compile_setting}"]
    )
    torch.manual_seed(0)
    model = apply_method(load_base_model(cfg.model), cfg)
    with torch.no_grad():  # a non-zero lora_B, so lora_A gets a gradient too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("double_quant", [True, False])
def test_eager_dequantize_is_torchaos_bit_for_bit(dtype, double_quant):
    q = nf4_weight(dtype, double_quant)
    want = q.get_original_weight()
    got = dequantize(q)
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)


def test_eager_linear_is_torchaos_linear_bit_for_bit():
    q = nf4_weight(torch.float32)
    linear = NF4Linear(64, 96, bias=False)
    linear.weight = torch.nn.Parameter(q, requires_grad=False)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, ref = linear(x), F.linear(x_ref, q)  # torchao: NF4Tensor.__torch_function__ -> LinearNF4
    assert torch.equal(out, ref)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    out.backward(grad)
    ref.backward(grad)
    assert torch.equal(x.grad, x_ref.grad)


def test_compiled_dequantize_matches_eager():
    # Inductor on the CPU: fp32 is bitwise; bf16 within one unit in the last place (the scale is
    # computed in fp32 and rounded once, where eager rounds after each op).
    q32, q16 = nf4_weight(torch.float32), nf4_weight(torch.bfloat16)
    torch.testing.assert_close(dequantize(q32, compiled=True), dequantize(q32), rtol=0, atol=0)
    got, want = dequantize(q16, compiled=True), dequantize(q16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)


def test_compiled_path_gives_eager_loss_and_lora_gradients():
    eager, compiled = qlora_micro(), qlora_micro()
    assert use_compiled_dequantize(compiled, True) == 4 * 7  # micro: 4 layers x 7 projections
    ids = torch.randint(0, 4000, (2, 24), generator=torch.Generator().manual_seed(3))
    results = []
    for model in (eager, compiled):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (want_loss, want), (got_loss, got) = results
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    assert got.keys() == want.keys() and any("lora_A" in n for n in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7)


def test_quantize_base_makes_nf4_linears_and_dequantize_base_plain_ones():
    model = qlora_micro()
    layers = causal_lm(model).model.layers
    linears = [m for m in layers.modules() if isinstance(m, NF4Linear)]
    assert len(linears) == 4 * 7 and all(is_nf4(m.weight) for m in linears)
    names = [n for n, _ in model.named_parameters()]
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" in names  # names unchanged
    dequantize_base(layers, NF4Spec())
    assert not any(isinstance(m, NF4Linear) for m in layers.modules())


def test_the_compiled_dequantisation_follows_model_compile():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert dequantize_compiled_wanted("auto", cuda) and not dequantize_compiled_wanted("auto", cpu)
    assert dequantize_compiled_wanted("true", cpu) and not dequantize_compiled_wanted("false", cuda)


def test_a_qlora_decoder_layer_traces_as_one_graph():
    """What `model.compile` does on CUDA (`compile_blocks`): the block, NF4 dequantisation
    included, is one graph (fullgraph=True raises on a graph break); aot_eager traces forward and
    backward without inductor's code generation, so this stays fast on the CPU."""
    model = qlora_micro()
    use_compiled_dequantize(model, True)
    layer = causal_lm(model).model.layers[0]
    rotary = causal_lm(model).model.rotary_emb
    hidden = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(4), requires_grad=True)
    positions = torch.arange(16)[None]
    embeddings = rotary(hidden, positions)
    want = layer(hidden, position_embeddings=embeddings, position_ids=positions)
    want.sum().backward()
    want_grad = hidden.grad.clone()
    hidden.grad = None
    torch._dynamo.reset()
    traced = torch.compile(layer, backend="aot_eager", fullgraph=True)
    got = traced(hidden, position_embeddings=embeddings, position_ids=positions)
    got.sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(hidden.grad, want_grad)
