"""The router's auxiliary losses (`distft.model.router`) on `qwen3-moe-micro`, against transformers'
own Qwen3-MoE loss (`output_router_logits=True`: the token mean plus `router_aux_loss_coef` x
the load-balancing loss) and against the z-loss written out from the router logits transformers
returns: the same gradients, a loss value left exactly the language model's, counted once under
activation checkpointing (whose recompute runs the routers again) and not at all without
gradients."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from distft.config import load_config
from distft.model import LossLM, apply_method, causal_lm, load_base_model
from distft.model.checkpointing import enable_checkpointing
from distft.model.compile import compile_blocks
from distft.model.router import router_losses

B, S, LABELLED = 2, 48, 16


def full_moe() -> torch.nn.Module:
    cfg = load_config(None, ["model.name=qwen3-moe-micro", "train.method=full"])
    torch.manual_seed(0)
    return apply_method(load_base_model(cfg.model), cfg)


def batch() -> dict[str, torch.Tensor]:
    """Two rows, the second right-padded by 8 (its padding routed, and masked out of the losses)."""
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 1000, (B, S), generator=g)
    attention_mask = torch.ones(B, S, dtype=torch.long)
    attention_mask[1, -8:] = 0
    hf_labels = torch.full((B, S), -100)  # transformers' labels: the token at each position
    hf_labels[0, -LABELLED:] = input_ids[0, -LABELLED:]
    hf_labels[1, -LABELLED - 8 : -8] = input_ids[1, -LABELLED - 8 : -8]
    labels = torch.cat([hf_labels[:, 1:], torch.full((B, 1), -100)], dim=1)  # distft's: shifted
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "hf_labels": hf_labels,
    }


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize(("aux_coef", "z_coef"), [(0.5, 0.0), (0.0, 0.3), (0.2, 0.1)])
def test_the_auxiliary_losses_train_as_transformers_computes_them(aux_coef, z_coef):
    lm = full_moe()
    data = batch()
    inputs = {k: v for k, v in data.items() if k != "hf_labels"}
    units = int((data["labels"] != -100).sum())
    plain_loss = LossLM(lm)(**inputs)

    router = router_losses(causal_lm(lm).model, aux_coef, z_coef)
    model = LossLM(lm, router=router)
    loss = model(**inputs)
    assert torch.equal(loss, plain_loss)  # the value is the language model's, bit for bit
    loss.backward()
    ours = gradients(lm)

    # transformers: mean token loss + coef x load balancing; the z-loss from the logits it returns.
    inner = causal_lm(lm)
    inner.router_aux_loss_coef = aux_coef  # read from the config when the model was built
    out = inner(
        input_ids=data["input_ids"],
        attention_mask=data["attention_mask"],
        labels=data["hf_labels"],
        output_router_logits=True,
    )
    mask = data["attention_mask"].reshape(-1).float()
    lse = torch.logsumexp(torch.stack(out.router_logits).float(), dim=-1)
    z_loss = (lse.square() * mask).sum() / (mask.sum() * len(out.router_logits))
    (units * (out.loss + z_coef * z_loss)).backward()
    theirs = gradients(lm)
    assert ours.keys() == theirs.keys() and any("mlp.gate" in n for n in ours)
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-6, msg=name)

    # The step's statistics: the values, weighted by the micro-batch's labelled tokens, and every
    # real token counted at its top-k experts in every layer.
    sums = router.take_stats(torch.device("cpu"))
    record = router.means(sums.tolist())
    E, k, layers = router.num_experts, router.top_k, router.num_layers
    aux = load_balancing_loss_func(out.router_logits, E, k, data["attention_mask"])
    assert record["router_aux_loss"] == pytest.approx(aux.item(), rel=1e-5)
    assert record["router_z_loss"] == pytest.approx(z_loss.item(), rel=1e-5)
    assert sum(record["expert_tokens"]) == int(mask.sum()) * k * layers
    assert record["expert_imbalance"] >= 1.0
    assert router.take_stats(torch.device("cpu")).abs().sum() == 0  # taken: a fresh start


def test_counted_once_under_checkpointing_and_compiled_and_not_without_gradients():
    """Full activation checkpointing reruns every router in the backward, and compiled decoder
    blocks (aot_eager, as the CPU compiles) trace the hooks: the same gradients and statistics as
    the plain eager forward. An evaluation (no gradients) records nothing."""
    data = {k: v for k, v in batch().items() if k != "hf_labels"}
    results = []
    for level, compiled in (("none", False), ("full", False), ("none", True)):
        lm = full_moe()
        enable_checkpointing(causal_lm(lm), level)
        if compiled:
            compile_blocks(lm, "aot_eager", strict=True)
        router = router_losses(causal_lm(lm).model, 0.5, 0.1)
        LossLM(lm, router=router)(**data).backward()
        results.append((gradients(lm), router.take_stats(torch.device("cpu"))))
    (plain, plain_stats), *others = results
    for grads, stats in others:
        torch.testing.assert_close(stats, plain_stats)
        for name in plain:
            torch.testing.assert_close(grads[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)

    lm = full_moe()
    router = router_losses(causal_lm(lm).model, 0.5, 0.1)
    with torch.no_grad():
        LossLM(lm, router=router)(**data)
    assert router.sums is None and not router.caught
    assert router_losses(causal_lm(load_base_model(load_config(None, []).model)).model, 0.5, 0.1) is None
