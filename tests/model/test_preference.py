"""The preference losses against their oracle, on the same log-probabilities.

ORPO's odds-ratio term is TRL's own function (`ORPOTrainer.odds_ratio_loss`, trl.experimental.orpo,
a test dependency). TRL 1.16 computes DPO inside `DPOTrainer._compute_loss`, from a model's
outputs, with no function to call on given log-probabilities: its formulas are re-derived below
from that method (trl/trainer/dpo_trainer.py: `sigmoid`, `hinge`, `ipo`), with conservative DPO's
label smoothing as TRL's `dpo_loss` wrote it before 1.0 (Mitchell's cDPO note). And each answer's
log-probability is the sum over its own tokens, whatever else the row holds. KTO likewise: TRL
1.16 computes it inside `KTOTrainer._compute_loss` (trl/trainer/kto_trainer.py, loss_type "kto"),
re-derived below."""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distft.model.preference import KTO_SUMS, PreferenceLoss, dpo_losses, orpo_odds_term, sequence_logps

torch.manual_seed(0)
PAIRS = 6
CHOSEN, REJECTED = -torch.rand(PAIRS) * 40 - 1, -torch.rand(PAIRS) * 40 - 1
REF_CHOSEN, REF_REJECTED = CHOSEN + torch.randn(PAIRS), REJECTED + torch.randn(PAIRS)
TOKENS_C, TOKENS_R = torch.randint(3, 30, (PAIRS,)).float(), torch.randint(3, 30, (PAIRS,)).float()


def trl_dpo(loss_type: str, beta: float, smoothing: float = 0.0) -> torch.Tensor:
    """TRL 1.16 `DPOTrainer._compute_loss`, reverse-KL (standard DPO), per sequence."""
    chosen_scores, rejected_scores = CHOSEN - REF_CHOSEN, REJECTED - REF_REJECTED
    delta = chosen_scores - rejected_scores
    if loss_type == "sigmoid":  # pre-1.0 `dpo_loss`: -logsig(b d)(1 - eps) - logsig(-b d) eps
        return -F.logsigmoid(beta * delta) * (1 - smoothing) - F.logsigmoid(-beta * delta) * smoothing
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    ipo_delta = chosen_scores / TOKENS_C.clamp(min=1.0) - rejected_scores / TOKENS_R.clamp(min=1.0)
    return (ipo_delta - 1 / (2 * beta)) ** 2


def test_dpo_matches_trl_for_every_loss_type_and_smoothing():
    for loss_type, beta, smoothing in [
        ("sigmoid", 0.1, 0.0),
        ("sigmoid", 0.5, 0.2),
        ("hinge", 0.1, 0.0),
        ("ipo", 0.3, 0.0),
    ]:
        losses, reward_c, reward_r = dpo_losses(
            CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, beta, loss_type, smoothing, TOKENS_C, TOKENS_R
        )
        torch.testing.assert_close(losses, trl_dpo(loss_type, beta, smoothing), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(reward_c, beta * (CHOSEN - REF_CHOSEN))  # TRL's rewards
        torch.testing.assert_close(reward_r, beta * (REJECTED - REF_REJECTED))
    # The policy at the reference: every margin 0, the sigmoid loss log 2 (a run's first step).
    same, _, _ = dpo_losses(CHOSEN, REJECTED, CHOSEN, REJECTED, 0.1)
    torch.testing.assert_close(same, torch.full((PAIRS,), math.log(2)))


def test_orpo_odds_term_is_trls_own_function():
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    mean_c, mean_r = CHOSEN / TOKENS_C, REJECTED / TOKENS_R  # ORPO's mean token log-probabilities
    trainer = types.SimpleNamespace(beta=0.25, accelerator=types.SimpleNamespace(device="cpu"))
    losses, reward_c, reward_r, _, _ = ORPOTrainer.odds_ratio_loss(trainer, mean_c, mean_r)
    torch.testing.assert_close(orpo_odds_term(mean_c, mean_r, 0.25), losses, rtol=1e-6, atol=1e-7)
    # ORPO's loss, NLL - mean(term), from the head: chosen token mean NLL through token_weight.
    head = PreferenceLoss("orpo", beta=0.25)
    logps, counts = torch.cat([CHOSEN, REJECTED]), torch.cat([TOKENS_C, TOKENS_R])
    weight = torch.tensor(PAIRS / TOKENS_C.sum().item())
    total = head(logps, counts, None, weight) / PAIRS  # the step divides by the pairs
    torch.testing.assert_close(total, -CHOSEN.sum() / TOKENS_C.sum() - losses.mean())
    stats = head.take_stats(torch.device("cpu")) / PAIRS
    torch.testing.assert_close(stats[:2], torch.stack([reward_c.mean(), reward_r.mean()]))
    assert head.take_stats(torch.device("cpu")).eq(0).all()  # taken: afresh


def trl_kto(labels, kl_policy, kl_reference, beta, desirable_weight, undesirable_weight):
    """TRL 1.16 `KTOTrainer._compute_loss`, loss_type "kto", one process: the loss, the rewards of
    the desirable and the undesirable answers, and the KL estimate z0."""
    kl = (kl_policy - kl_reference).mean().detach().clamp(min=0)
    chosen_logratios = CHOSEN[labels] - REF_CHOSEN[labels]
    rejected_logratios = CHOSEN[~labels] - REF_CHOSEN[~labels]
    chosen_losses = 1 - F.sigmoid(beta * (chosen_logratios - kl))
    rejected_losses = 1 - F.sigmoid(beta * (kl - rejected_logratios))
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses), 0)
    return losses.nanmean(), beta * chosen_logratios, beta * rejected_logratios, kl


def test_kto_matches_trl_with_weights_and_a_kl_estimate_kept_at_or_above_zero():
    labels = torch.tensor([True, False, True, True, False, True])
    for beta, wd, wu, shift in [(0.1, 1.0, 1.0, 0.7), (0.5, 1.0, 1.33, 0.0), (0.2, 0.8, 1.0, -2.0)]:
        kl_policy = CHOSEN + shift + torch.randn(PAIRS)  # shift < 0: the mean is below 0, clamped
        loss, reward_d, reward_u, kl = trl_kto(labels, kl_policy, CHOSEN, beta, wd, wu)
        head = PreferenceLoss("kto", beta=beta, desirable_weight=wd, undesirable_weight=wu)
        ours = (kl_policy - CHOSEN).mean().clamp(min=0)  # what `distft.train.step.with_kl` computes
        torch.testing.assert_close(ours, kl)
        # The answers of a micro-batch and a packed row's fill after them (no label: not scored).
        logps, counts = torch.cat([CHOSEN, torch.zeros(1)]), torch.cat([TOKENS_C, torch.zeros(1)])
        total = head(logps, counts, torch.cat([REF_CHOSEN, torch.zeros(1)]), desirable=labels, kl=ours)
        torch.testing.assert_close(total / PAIRS, loss, rtol=1e-6, atol=1e-7)  # the step divides by answers
        means = head.means(head.take_stats(torch.device("cpu")).tolist(), PAIRS)
        assert means["rewards_chosen"] == pytest.approx(reward_d.mean().item(), rel=1e-5)
        assert means["rewards_rejected"] == pytest.approx(reward_u.mean().item(), rel=1e-5)
        assert means["margin"] == pytest.approx((reward_d.mean() - reward_u.mean()).item(), rel=1e-5)
        assert means["logps_chosen"] == pytest.approx(CHOSEN[labels].mean().item(), rel=1e-5)
    # At the reference (step 1: z0 = 0, every ratio 0) each answer's loss is 1 - sigmoid(0) = 1/2.
    head = PreferenceLoss("kto")
    assert head(CHOSEN, TOKENS_C, CHOSEN, desirable=labels, kl=torch.tensor(0.0)).item() == PAIRS / 2
    # A batch without undesirable answers has no mean for them.
    sums = dict.fromkeys(KTO_SUMS, 1.0) | {"undesirable": 0.0}
    assert head.means(list(sums.values()), 1)["rewards_rejected"] is None


def test_each_rows_log_probability_sums_its_own_labelled_tokens():
    """Two rows of different lengths (one padded): each row's sum over its labels only."""
    torch.manual_seed(1)
    head = nn.Linear(8, 11, bias=False)
    hidden = torch.randn(2, 5, 8)
    labels = torch.tensor([[-100, 3, 4, -100, -100], [-100, -100, 7, 1, 2]])
    logps, counts = sequence_logps(hidden, head, labels)
    log_softmax = head(hidden).float().log_softmax(-1)
    want = [sum(log_softmax[r, t, labels[r, t]] for t in range(5) if labels[r, t] != -100) for r in range(2)]
    torch.testing.assert_close(logps, torch.stack(want))
    assert counts.tolist() == [2.0, 3.0]


def test_a_packed_rows_documents_are_scored_each_on_its_own():
    """Three documents end to end (positions restart at 0), the last a fill without labels."""
    torch.manual_seed(2)
    head = nn.Linear(8, 11, bias=False)
    hidden = torch.randn(1, 7, 8)
    labels = torch.tensor([[4, -100, 2, 9, -100, -100, -100]])
    positions = torch.tensor([[0, 1, 0, 1, 2, 0, 1]])
    logps, counts = sequence_logps(hidden, head, labels, positions)
    log_softmax = head(hidden).float().log_softmax(-1)[0]
    torch.testing.assert_close(
        logps, torch.stack([log_softmax[0, 4], log_softmax[2, 2] + log_softmax[3, 9], torch.tensor(0.0)])
    )
    assert counts.tolist() == [1.0, 2.0, 0.0] and PreferenceLoss.pairs_in(logps) == 1  # the fill is no pair
