"""model.fp8 (`distft.model.fp8`): which Linear layers turn float8, that nothing else changes (names,
state dict, the exported adapter), gradients close to bf16's, FSDP2 over them, and the refusals.

On the CPU torch emulates `_scaled_mm` (the e4m3 casts and the scales are real), so the conversion
and its numerics run here; the speed is measured on a GPU (`distft bench --gpu`, docs/fp8.md).
"""

import pytest
import torch
import torch.distributed as dist
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from peft import get_peft_model_state_dict
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch.distributed.device_mesh import init_device_mesh
from torchao.float8.float8_linear import Float8Linear

from distft.config import load_config
from distft.config.choices import PROJECTION_NAMES
from distft.errors import ConfigError
from distft.model import apply_method, causal_lm, load_base_model
from distft.model.fp8 import (
    check_fp8_hardware,
    convert_layers,
    convert_to_float8,
    float8_candidate,
    fp8_hardware_refusal,
)
from distft.parallel import check_config
from distft.parallel.fsdp import shard_units
from tests.helpers import free_port, spawn

LAYERS = 4  # micro's decoder layers; every projection's dims are multiples of 16 (32, 16, 96)
BF16 = ["model.name=micro", "model.dtype=bfloat16"]
# Measured on micro, 64 tokens: the LoRA gradient's cosine with bf16's 0.982 (relative difference
# 0.19: one float8 matmul is off by ~4%, and 4 layers of them compound); full finetuning 0.975.
MIN_COSINE = 0.95


def micro(fp8: str, *overrides: str) -> nn.Module:
    cfg = load_config(None, [*BF16, f"model.fp8={fp8}", *overrides])
    torch.manual_seed(0)
    return apply_method(load_base_model(cfg.model, "cpu"), cfg)


def with_trained_b(model: nn.Module) -> nn.Module:
    """lora_B starts at zero, and with it lora_A's gradient: a nonzero B, the same for every model."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    return model


def gradients(model: nn.Module, tokens: int = 64) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 1000, (1, tokens), generator=torch.Generator().manual_seed(2))
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def cosine(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    flat = [torch.cat([g[n].flatten() for n in sorted(a)]) for g in (a, b)]
    return torch.nn.functional.cosine_similarity(*flat, dim=0).item()


def float8_names(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}


def projections(suffix: str) -> set[str]:
    return {
        f"base_model.model.model.layers.{i}.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}{suffix}"
        for i in range(LAYERS)
        for p in PROJECTION_NAMES
    }


def test_base_turns_exactly_the_frozen_projections_under_the_adapters_float8():
    plain, fp8 = micro("off"), micro("base")
    assert float8_names(fp8) == projections(".base_layer")  # no lora_A/B, no lm_head, no embedding
    assert type(causal_lm(fp8).lm_head) is nn.Linear
    # Names, values and the adapter peft exports are the bf16 model's.
    assert fp8.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(v, fp8.state_dict()[k]) for k, v in plain.state_dict().items())
    adapter, adapter8 = get_peft_model_state_dict(plain), get_peft_model_state_dict(fp8)
    assert adapter.keys() == adapter8.keys() and len(adapter) == 2 * LAYERS * len(PROJECTION_NAMES)
    assert all(torch.equal(v, adapter8[k]) for k, v in adapter.items())
    assert convert_to_float8(fp8, "base") == 0  # converted once: a second call finds nothing left
    assert convert_to_float8(micro("off"), "base") == LAYERS * len(PROJECTION_NAMES)


def test_base_lora_gradients_are_close_to_bfloat16_and_the_base_gets_none():
    plain, fp8 = gradients(with_trained_b(micro("off"))), gradients(with_trained_b(micro("base")))
    assert all("lora_" in name for name in fp8) and len(fp8) == 2 * LAYERS * len(PROJECTION_NAMES)
    assert cosine(plain, fp8) > MIN_COSINE
    assert all(torch.isfinite(g).all() for g in fp8.values())
    assert any(not torch.equal(plain[n], fp8[n]) for n in plain)  # float8 did run: not bf16's bits


def test_all_turns_every_decoder_linear_of_a_full_finetune_float8():
    plain, fp8 = micro("off", "train.method=full"), micro("all", "train.method=full")
    assert float8_names(fp8) == {n.removeprefix("base_model.model.") for n in projections("")}
    assert type(causal_lm(fp8).lm_head) is nn.Linear
    assert fp8.state_dict().keys() == plain.state_dict().keys()
    g, g8 = gradients(plain), gradients(fp8)
    assert all(f"{name}.weight" in g8 for name in float8_names(fp8))  # the float8 weights train
    layers = [n for n in g if ".layers." in n]
    assert cosine({n: g[n] for n in layers}, {n: g8[n] for n in layers}) > MIN_COSINE


def test_a_linear_torchao_cannot_multiply_stays_as_it_is():
    assert float8_candidate(nn.Linear(32, 48), "0.mlp.up_proj.base_layer", "base")
    assert not float8_candidate(nn.Linear(24, 48), "0.mlp.up_proj.base_layer", "base")  # 24: not 16-aligned
    assert not float8_candidate(nn.Linear(32, 40), "0.mlp.up_proj", "all")
    assert not float8_candidate(nn.Linear(32, 48), "0.mlp.up_proj.lora_A.default", "base")  # an adapter
    assert float8_candidate(nn.Linear(32, 48), "0.mlp.up_proj", "all")


def scaled_matmuls_compiled(linear: nn.Linear) -> dict[str, int]:
    """The float8 matmuls in the forward and backward graphs AOT autograd builds for `linear`,
    partitioned as inductor partitions them (a frozen weight's unused gradient is dead code)."""
    found: dict[str, int] = {}

    def counting(graph: str):
        def compiler(gm: torch.fx.GraphModule, inputs):
            found[graph] = sum("scaled_mm" in str(node.target) for node in gm.graph.nodes)
            return make_boxed_func(gm.forward)

        return compiler

    backend = aot_autograd(
        fw_compiler=counting("forward"),
        bw_compiler=counting("backward"),
        partition_fn=min_cut_rematerialization_partition,
    )
    compiled = torch.compile(linear, backend=backend, dynamic=True)
    compiled(torch.randn(37, 32, dtype=torch.bfloat16, requires_grad=True)).sum().backward()
    return found


@pytest.mark.parametrize(("frozen", "backward"), [(True, 1), (False, 2)])
def test_compiled_a_frozen_weight_s_float8_gradient_matmul_is_dropped(frozen, backward):
    """torchao's backward computes dW for every weight; compiled, a frozen one's is dead code, so
    LoRA's base runs two float8 matmuls (forward, dX), a trained weight three (37 tokens: padded)."""
    model = nn.Sequential(nn.Linear(32, 48, bias=False).to(torch.bfloat16))
    model[0].weight.requires_grad_(not frozen)
    assert convert_layers(model, "all") == 1
    assert scaled_matmuls_compiled(model[0]) == {"forward": 1, "backward": backward}


def _fsdp_rank(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    alone = gradients(with_trained_b(micro("base")))
    model = with_trained_b(micro("base"))
    cfg = load_config(None, [*BF16, "model.fp8=base", "parallel.strategy=fsdp"])
    shard_units(model, list(causal_lm(model).model.layers), init_device_mesh("cpu", (2,)), cfg, True)
    sharded = {n: g.full_tensor() for n, g in gradients(model).items()}  # averaged over equal batches
    assert len(float8_names(model)) == LAYERS * len(PROJECTION_NAMES)
    assert sharded.keys() == alone.keys()
    assert all(torch.allclose(sharded[n], alone[n], rtol=1e-3, atol=1e-6) for n in alone)
    dist.destroy_process_group()


def test_fsdp2_shards_and_gathers_the_float8_base_and_the_gradients_are_one_process_s():
    spawn(_fsdp_rank, (free_port(),), nprocs=2, timeout=120)


LORA = [*BF16, "model.fp8=base"]


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ([*LORA, "train.method=full"], "model.fp8=base runs with --method lora, not full"),
        ([*LORA, "train.method=qlora"], "QLoRA's frozen base is 4-bit NF4, not bf16): use --method lora"),
        ([*BF16, "model.fp8=all"], "model.fp8=all runs with --method full, not lora"),
        ([*LORA, "model.dtype=float32"], "set model.dtype=bfloat16 (it is float32)"),
        ([*LORA, "parallel.strategy=tp"], "model.fp8=base cannot run with --strategy tp"),
        ([*LORA, "parallel.strategy=pp"], "FSDP-gathered (single, ddp, zero2, fsdp)"),
        ([*LORA, "parallel.strategy=zero1"], "cannot run with --strategy zero1"),
        ([*LORA, "parallel.strategy=cp"], "cannot run with --strategy cp"),
    ],
)
def test_a_method_dtype_or_strategy_float8_cannot_run_with_is_refused_in_one_line(overrides, says):
    with pytest.raises(ConfigError) as refused:
        check_config(load_config(None, overrides))
    assert says in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp", "zero2"])
def test_the_strategies_that_compute_each_linear_whole_take_it(strategy):
    check_config(load_config(None, [*LORA, f"parallel.strategy={strategy}"]))
    check_config(
        load_config(None, [*BF16, "model.fp8=all", "train.method=full", f"parallel.strategy={strategy}"])
    )


def test_an_unknown_value_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match=r"`model.fp8` is 'on'; choose one of off, base, all"):
        load_config(None, ["model.fp8=on"])


def test_float8_needs_a_gpu_of_compute_capability_8_9():
    cpu = fp8_hardware_refusal("base", "cpu", [])
    assert "needs a CUDA GPU of compute capability 8.9 or newer" in cpu and "on the CPU" in cpu
    a100 = fp8_hardware_refusal("all", "cuda", [(0, "NVIDIA H100", (9, 0)), (1, "NVIDIA A100", (8, 0))])
    assert "but GPU 1 (NVIDIA A100, compute capability 8.0) is older" in a100 and "GPU 0" not in a100
    assert fp8_hardware_refusal("base", "cuda", [(0, "NVIDIA H100", (9, 0))]) is None
    assert fp8_hardware_refusal("base", "cuda", [(0, "NVIDIA L40S", (8, 9))]) is None
    assert fp8_hardware_refusal("off", "cpu", []) is None
    assert all("\n" not in line for line in (cpu, a100))
    with pytest.raises(ConfigError, match="no float8 matmul kernels"):
        check_fp8_hardware("base", torch.device("cpu"))
    check_fp8_hardware("off", "cpu")
