"""Compiled decoder blocks: the same loss and gradients as eager, and refused where a strategy cannot take them."""

import copy

import pytest
import torch

from distft.config import load_config
from distft.errors import ConfigError
from distft.model import SummaryLM, apply_method, load_base_model
from distft.model.compile import compile_blocks, compile_wanted
from distft.parallel import check_config

# Inductor's CPU kernels fuse and reorder fp32 reductions (RMSNorm, softmax, SiLU*up), so results
# differ from eager by rounding. The loss to 1e-5 relative; each gradient tensor to 1e-4 in relative
# norm of the difference (an element near zero can differ by 1e-3 of itself, as in any parallel run).
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


def lora_micro() -> SummaryLM:
    cfg = load_config(None, ["model.name=micro", "lora.rank=4"])
    torch.manual_seed(0)
    return SummaryLM(apply_method(load_base_model(cfg.model), cfg))


def loss_and_grads(model: SummaryLM, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_compiled_blocks_match_eager_loss_and_gradients():
    eager = lora_micro()
    with torch.no_grad():  # a non-zero lora_B, so lora_A gets a gradient too
        for name, p in eager.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    compiled = copy.deepcopy(eager)
    assert compile_blocks(compiled.lm) == 4
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 5000, (2, 48), generator=gen)
    labels = torch.where(torch.arange(48) >= 24, torch.roll(ids, -1, 1), -100)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    want_loss, want = loss_and_grads(eager, batch)
    got_loss, got = loss_and_grads(compiled, batch)
    torch.testing.assert_close(got_loss, want_loss, rtol=LOSS_RTOL, atol=0.0)
    assert got.keys() == want.keys() and any("lora_A" in n for n in got)
    for name in want:
        error = (got[name] - want[name]).norm() / want[name].norm()
        assert error < GRAD_RTOL, f"{name}: relative error {error:.2e}"
    # In place: the names (and so the exported adapter) are those of the eager model.
    assert list(compiled.state_dict()) == list(eager.state_dict())


def test_auto_compiles_on_cuda_only_where_the_strategy_can():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert compile_wanted("auto", cuda, strategy_supports=True)
    assert not compile_wanted("auto", cuda, strategy_supports=False)
    assert not compile_wanted("auto", cpu, strategy_supports=True)
    assert compile_wanted("true", cpu, strategy_supports=True)
    assert not compile_wanted("false", cuda, strategy_supports=True)


@pytest.mark.parametrize("strategy", ["tp", "tp-sp", "pp", "fsdp+tp", "ddp+pp", "fsdp+pp", "fsdp+tp+pp"])
def test_compile_true_is_refused_before_launch_where_blocks_are_rewritten(strategy):
    cfg = load_config(None, [f"parallel.strategy={strategy}", "parallel.nproc=2", "model.compile=true"])
    with pytest.raises(ConfigError, match=r"model\.compile=true cannot run with --strategy"):
        check_config(cfg)


def test_compile_setting_is_checked():
    with pytest.raises(ConfigError, match=r"model\.compile"):
        load_config(None, ["model.compile=yes"])
