"""`model.experts_implementation` (`distft.model.experts`) on `qwen3-moe-micro`: the setting reaches
every layer's experts module and its forward dispatches to the implementation named; grouped_mm,
batched_mm and grouped_lora give eager's loss and gradients on the same batch, under LoRA
(adapters on the experts, made non-zero so the experts' deltas take part) and under full
finetuning, the experts' own weights receiving gradient; grouped_lora keeps the adapters' rank-r
products for backward where the others keep a merged copy of every expert (or the merged copy,
where that costs fewer multiply-adds), and fewer bytes per routed row (no SiLU output, no expert
output)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils import parametrize
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from distft.config import load_config
from distft.measure.activations import SavedActivations
from distft.model import LossLM, apply_method, load_base_model
from distft.model import experts as experts_module
from distft.model.experts import AUTO, experts_modules, implementations_in_effect, merges_delta

B, S = 2, 40


def build(implementation: str, method: str, *overrides: str) -> torch.nn.Module:
    cfg = load_config(
        None,
        [
            "model.name=qwen3-moe-micro",
            f"model.experts_implementation={implementation}",
            f"train.method={method}",
            *overrides,
        ],
    )
    torch.manual_seed(0)  # the base's weights are the preset's; peft's lora_A draws from this seed
    lm = apply_method(load_base_model(cfg.model), cfg)
    if method == "lora":  # peft starts lora_B at zero: a trained adapter's deltas are not
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for name, p in lm.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return lm


def batch() -> dict[str, torch.Tensor]:
    """Two rows, the second right-padded by 6: padding is routed too, and masked out of the loss."""
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 1000, (B, S), generator=g)
    attention_mask = torch.ones(B, S, dtype=torch.long)
    attention_mask[1, -6:] = 0
    labels = torch.cat([input_ids[:, 1:], torch.full((B, 1), -100)], dim=1)
    labels[attention_mask == 0] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def loss_and_gradients(implementation: str, method: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    lm = build(implementation, method)
    assert implementations_in_effect(lm) == {implementation}  # else the comparison is with itself
    loss = LossLM(lm)(**batch())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in lm.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("method", ["lora", "full"])
def test_every_implementation_trains_as_eager(method):
    loss, grads = loss_and_gradients("eager", method)
    # The experts take part in what trains: their adapters (LoRA) or their stacked weights (full).
    experts = [n for n in grads if "experts" in n]
    assert experts and all(grads[n].abs().sum() > 0 for n in experts), experts
    for implementation in ("grouped_mm", "batched_mm", "grouped_lora"):
        other_loss, other_grads = loss_and_gradients(implementation, method)
        torch.testing.assert_close(other_loss, loss, rtol=1e-5, atol=0)
        assert other_grads.keys() == grads.keys()
        for name, grad in grads.items():
            # atol: entries near zero, where a different summation order is all that differs
            atol = 1e-5 * grad.abs().max().item()
            torch.testing.assert_close(other_grads[name], grad, rtol=1e-5, atol=atol, msg=name)


@pytest.mark.parametrize("implementation", ["auto", "eager", "grouped_mm", "batched_mm", "grouped_lora"])
def test_the_setting_reaches_every_layers_experts(implementation, monkeypatch):
    """Read where the experts read it (their config), and seen in the forward: transformers looks
    the name up in `ALL_EXPERTS_FUNCTIONS` (eager: the class's own forward, in no table) at every
    call; grouped_lora's adapted experts are computed from peft's wrappers, before that lookup."""
    called: list[str] = []
    for name, forward in list(ALL_EXPERTS_FUNCTIONS.items()):

        def spy(*args, name=name, forward=forward, **kwargs):
            called.append(name)
            return forward(*args, **kwargs)

        monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS._global_mapping, name, spy)
    direct: list[str] = []
    grouped = experts_module.grouped_experts
    monkeypatch.setattr(experts_module, "grouped_experts", lambda *a: direct.append(AUTO) or grouped(*a))
    lm = build(implementation, "lora")
    expected = AUTO if implementation == "auto" else implementation
    assert len(experts_modules(lm)) == 4  # qwen3-moe-micro's layers, each under peft's wrappers
    assert implementations_in_effect(lm) == {expected}
    with torch.no_grad():
        LossLM(lm)(**batch())
    assert called == ([] if expected in ("eager", AUTO) else [expected] * 4)
    assert direct == ([AUTO] * 4 if expected == AUTO else [])


def test_grouped_lora_reads_the_adapters_without_peft_parametrization(monkeypatch):
    """Under grouped_lora the adapters' factors are read from peft's wrappers: no stack is
    parametrized (peft's way, grouped_mm's here, computes each merged stack once per forward to
    check it). With the adapters disabled (a preference loss's reference model) both give the
    base's output."""
    registered: list[str] = []
    register = parametrize.register_parametrization
    monkeypatch.setattr(
        parametrize,
        "register_parametrization",
        lambda m, n, *a, **k: registered.append(n) or register(m, n, *a, **k),
    )
    counts, outputs = {}, {}
    for implementation in ("grouped_mm", "grouped_lora"):
        lm = build(implementation, "lora")
        registered.clear()
        loss = LossLM(lm)(**batch())
        loss.backward()
        counts[implementation] = len(registered)
        with torch.no_grad(), lm.disable_adapter():
            outputs[implementation] = lm(**batch()).logits
    assert counts == {"grouped_mm": 8, "grouped_lora": 0}  # 2 stacks x 4 layers, at every forward
    torch.testing.assert_close(outputs["grouped_lora"], outputs["grouped_mm"], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        base = build("grouped_lora", "full")(**batch()).logits  # the same base weights, no adapters
    torch.testing.assert_close(outputs["grouped_lora"], base, rtol=1e-5, atol=1e-5)


def test_a_dense_model_ignores_the_setting():
    cfg = load_config(None, ["model.name=micro", "model.experts_implementation=batched_mm"])
    lm = load_base_model(cfg.model)
    assert implementations_in_effect(lm) == set() and lm.config._experts_implementation != "batched_mm"


@pytest.mark.parametrize("rank", [16, 5])  # 5: rows of 20 bytes, below the grouped kernel's alignment
def test_grouped_lora_keeps_the_factors_or_the_cheaper_merge(rank):
    """Per MoE layer, what backward keeps changes by exactly: for each stack, a contiguous copy
    of its B (E out r floats); for each whose delta goes through the rows, minus the merged stack
    (E out in) and plus each routed row's rank-r product (2 x 40 tokens x k = 2 rows), the delta
    merged where that is cheaper (at rank 16 here, down_proj's, the narrower); per routed row, minus
    SiLU's output (SwiGLU recomputes it), the expert's output (the routing weight multiplies the
    row before the down projection) and the row's token (the pairs' permutation serves);
    the loss and gradients are grouped_mm's."""
    saved, results = {}, {}
    for implementation in ("grouped_mm", "grouped_lora"):
        lm = build(implementation, "lora", f"lora.rank={rank}")
        model = LossLM(lm)
        with SavedActivations(model) as probe:
            loss = model(**batch())
        loss.backward()
        saved[implementation] = probe.bytes
        results[implementation] = (
            loss.detach(),
            {n: p.grad for n, p in lm.named_parameters() if p.grad is not None},
        )
    (loss, grads), (other_loss, other_grads) = results["grouped_mm"], results["grouped_lora"]
    torch.testing.assert_close(other_loss, loss, rtol=1e-5, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(other_grads[name], grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item())
    experts, inter, hidden, rows = 8, 24, 32, B * S * 2
    stacks = ((2 * inter, hidden), (hidden, inter))  # gate_up_proj, down_proj: (out, in)
    merged = [merges_delta(rows, experts, out, inp, rank) for out, inp in stacks]
    assert merged == ([False, True] if rank == 16 else [False, False])  # both ways are measured
    per_layer = sum(
        4 * (experts * out * rank + (0 if merges else rows * rank - experts * out * inp))
        for (out, inp), merges in zip(stacks, merged, strict=True)
    ) - rows * (4 * inter + 4 * hidden + 8)
    assert saved["grouped_lora"] - saved["grouped_mm"] == 4 * per_layer < 0
