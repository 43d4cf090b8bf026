"""The preference objectives: each answer's log-probability, and the losses built on them.

A micro-batch of B pairs is 2B rows, the B chosen answers first (`distft.data.pairs`). The head
gives each row's log-probability under the policy, log pi(y|x), the sum of its answer tokens'
log-probabilities (`sequence_logps`), and from those one loss per pair:

DPO (Rafailov et al. 2023, arXiv 2305.18290), with the reference pi_ref the model as it starts:
    h = beta x [(log pi(y_c) - log pi_ref(y_c)) - (log pi(y_r) - log pi_ref(y_r))]
    sigmoid:  -(1 - eps) log sigmoid(h) - eps log sigmoid(-h)    (eps: dpo.label_smoothing, cDPO)
    hinge:    max(0, 1 - h)                                     (SLiC, arXiv 2305.10425)
    ipo:      (d - 1 / (2 beta))^2, d the same margin with each answer's log-ratio divided by its
              token count                                       (IPO, arXiv 2310.12036)
    rewards:  beta x (log pi(y) - log pi_ref(y)) per answer; accuracy: chosen reward > rejected.
TRL's `DPOTrainer._compute_loss` (trl 1.16, trainer/dpo_trainer.py) computes the same terms.

ORPO (Hong et al. 2024, arXiv 2403.07691), no reference, with mean token log-probabilities
m = log pi(y) / |y|:
    log odds(y) = m - log(1 - exp(m));   L = NLL(y_c) - lambda x log sigmoid(log odds(y_c) - log odds(y_r))
NLL is the chosen answers' mean token loss over the global batch, lambda is dpo.beta; the second
term is TRL's `ORPOTrainer.odds_ratio_loss` (trl.experimental.orpo), rewards lambda x m.

KTO (Ethayarajh et al. 2024, arXiv 2402.01306, eq. 7) on single answers y, each desirable or not,
r = log pi(y) - log pi_ref(y):
    z0 = max(0, mean over the global batch of log pi(y') - log pi_ref(y'))   no gradient
    desirable:    lambda_D x (1 - sigmoid(beta x (r - z0)))
    undesirable:  lambda_U x (1 - sigmoid(beta x (z0 - r)))
    rewards beta x r, averaged over the desirable and the undesirable answers apart.
z0 estimates KL(pi || pi_ref) from mismatched answers y' (each prompt with another row's answer,
`distft.data.pairs`), scored before the step's forward (`distft.train.reference.kto_kl`) so that
it is one number for the whole global batch, whatever its split; lambda_D and lambda_U are
dpo.desirable_weight and dpo.undesirable_weight. TRL's `KTOTrainer._compute_loss` (trl 1.16,
trainer/kto_trainer.py) computes the same terms, its z0 over each step's micro-batches.

The reference costs no second model: under LoRA and QLoRA it is the same base with the adapters
disabled (peft's `disable_adapter`), run under `no_grad` in the same forward, which is the model
as a fresh adapter starts (lora_B = 0).

Every loss is summed over the micro-batch's pairs (KTO: answers); the step divides by those of the global
batch (`Strategy.forward_backward`'s normaliser), so the result is the mean over the global batch
whatever the split across ranks. ORPO's NLL is per token: each pair's NLL sum arrives weighted by
pairs / chosen tokens of the global batch (`token_weight`), so that it too ends a global mean.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from distft.config.choices import WITH_REFERENCE

STATS = ("rewards_chosen", "rewards_rejected", "accuracy", "margin", "logps_chosen", "logps_rejected")
# KTO's sums, as many: rewards and log-probabilities of the desirable and the undesirable answers, and their counts.
KTO_SUMS = (
    "rewards_chosen",
    "rewards_rejected",
    "logps_chosen",
    "logps_rejected",
    "desirable",
    "undesirable",
)


def sequence_logps(
    hidden: torch.Tensor,  # (rows, seq, hidden)
    lm_head: nn.Module,
    labels: torch.Tensor,  # (rows, seq), shifted, -100 where no loss
    position_ids: torch.Tensor | None = None,  # packed: from 0 at each document
    documents: tuple[torch.Tensor, int] | None = None,  # a sequence shard's: (rows, seq) ids, and how many
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's summed log-probability of its labelled tokens, and their count: (sequences,)
    each. A sequence is a row, or in a packed row each document (its positions restart at 0); a
    shard of the sequence (tp-sp) gives its positions' documents and their number in the row."""
    keep = labels != -100
    if documents is not None:
        owner, sequences = documents[0][keep], documents[1]
    elif position_ids is None:
        owner, sequences = keep.nonzero()[:, 0], labels.shape[0]
    else:  # one packed row: the document of each position, counted from the row's start
        ids = (position_ids.flatten() == 0).cumsum(0) - 1
        owner, sequences = ids[keep.flatten()], int(ids[-1]) + 1
    logits = lm_head(hidden[keep]).float()  # (labelled, vocab)
    token_logps = -F.cross_entropy(logits, labels[keep], reduction="none")
    logps = torch.zeros(sequences, device=hidden.device).index_add(0, owner, token_logps)
    counts = torch.zeros(sequences, device=hidden.device).index_add(0, owner, torch.ones_like(token_logps))
    return logps, counts


def labelled_sequences(labels: torch.Tensor, position_ids: torch.Tensor | None = None) -> int:
    """How many sequences of a micro-batch carry a label (`sequence_logps`'s, less a packed row's
    fill): the length of its scores, known without the model."""
    if position_ids is None:
        return int((labels != -100).any(dim=1).sum())
    documents = (position_ids.flatten() == 0).cumsum(0) - 1
    return int(documents[labels.flatten() != -100].unique().numel())


def dpo_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair: the DPO loss, the chosen and the rejected reward (formulas above)."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    h = beta * (chosen_ratio - rejected_ratio)
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
    elif loss_type == "hinge":
        losses = torch.relu(1 - h)
    elif loss_type == "ipo":
        assert chosen_tokens is not None and rejected_tokens is not None, "ipo averages per token"
        d = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        losses = (d - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss {loss_type!r}")
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def kto_losses(
    logps: torch.Tensor,
    reference: torch.Tensor,
    desirable: torch.Tensor,  # bool, per answer
    kl: torch.Tensor,  # z0, 0-d, no gradient
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per answer: the KTO loss and its reward (formulas above)."""
    ratio = logps - reference
    losses = torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
        undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))),
    )
    return losses, beta * ratio.detach()


def log_odds(mean_logps: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) of p = exp(mean_logps), stable near p = 1."""
    return mean_logps - torch.log(-torch.expm1(mean_logps))


def orpo_odds_term(chosen_mean: torch.Tensor, rejected_mean: torch.Tensor, beta: float) -> torch.Tensor:
    """Per pair: lambda x log sigmoid(log odds(y_c) - log odds(y_r)), the term ORPO subtracts."""
    return beta * F.logsigmoid(log_odds(chosen_mean) - log_odds(rejected_mean))


@dataclass
class PreferenceLoss:
    """What `LossLM` computes for a preference objective, and the step's statistics so far."""

    objective: str  # dpo | orpo | kto
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    stats: torch.Tensor | None = field(default=None, repr=False)  # sums of `STATS` (`KTO_SUMS`) on this rank
    share: float = field(default=1.0, repr=False)  # of the micro-batch being computed (`__call__`)

    @property
    def needs_reference(self) -> bool:
        return self.objective in WITH_REFERENCE

    def __call__(
        self,
        logps: torch.Tensor,
        counts: torch.Tensor,
        reference: torch.Tensor | None,
        token_weight: torch.Tensor | None = None,
        desirable: torch.Tensor | None = None,
        kl: torch.Tensor | None = None,
        share: float = 1.0,
    ) -> torch.Tensor:
        """The sum of this micro-batch's pair losses, from every row's (policy) log-probability and
        token count, the reference's, and (ORPO) pairs / chosen tokens of the global batch; KTO's
        from each answer's label and the global batch's KL estimate. `share`: this rank's share of
        a loss every rank of a sequence split computes whole (tp-sp), the loss and statistics
        scaled by it, so that their sum over the ranks is the loss once."""
        self.share = share
        if self.objective == "kto":
            n = len(desirable)
            return self._kto(logps[:n], reference[:n], desirable, kl, counts[:n] > 0) * share
        pairs = self.pairs_in(logps)
        chosen, rejected = logps[:pairs], logps[pairs : 2 * pairs]
        chosen_n, rejected_n = counts[:pairs], counts[pairs : 2 * pairs]
        # A pair without labels (a pipeline's blank pair, filling a short batch) counts nothing.
        real = chosen_n > 0
        if reference is not None:
            reference = reference[: 2 * pairs]
        if self.objective == "dpo":
            ref_chosen, ref_rejected = reference.chunk(2)
            losses, reward_c, reward_r = dpo_losses(
                chosen, rejected, ref_chosen, ref_rejected, self.beta, self.loss_type,
                self.label_smoothing, chosen_n, rejected_n,
            )  # fmt: skip
        else:  # a blank pair's mean set apart from 0, where the log odds are infinite
            chosen_mean = torch.where(real, chosen / chosen_n.clamp(min=1), -1.0)
            rejected_mean = torch.where(real, rejected / rejected_n.clamp(min=1), -1.0)
            losses = -chosen * token_weight - orpo_odds_term(chosen_mean, rejected_mean, self.beta)
            reward_c, reward_r = self.beta * chosen_mean.detach(), self.beta * rejected_mean.detach()
        zero = torch.zeros_like(reward_c)
        self._record(
            torch.where(real, reward_c, zero),
            torch.where(real, reward_r, zero),
            chosen.detach(),
            rejected.detach(),
        )
        return torch.where(real, losses, torch.zeros_like(losses)).sum() * share

    def _kto(self, logps, reference, desirable, kl, real) -> torch.Tensor:
        losses, rewards = kto_losses(
            logps, reference, desirable, kl, self.beta, self.desirable_weight, self.undesirable_weight
        )
        losses = torch.where(real, losses, torch.zeros_like(losses))  # a blank answer counts nothing
        d, u = (desirable & real).float(), (~desirable & real).float()
        sums = torch.stack(
            [rewards @ d, rewards @ u, logps.detach() @ d, logps.detach() @ u, d.sum(), u.sum()]
        )
        self._add(sums)
        return losses.sum()

    def means(self, sums: list[float], n: int) -> dict[str, float]:
        """The step's statistics from their sums over the global batch of `n` pairs (KTO: answers)."""
        if self.objective != "kto":
            return {name: value / n for name, value in zip(STATS, sums, strict=True)}
        s = dict(zip(KTO_SUMS, sums, strict=True))

        def mean(name: str, count: str) -> float | None:  # None: no such answer in the batch
            return s[name] / s[count] if s[count] else None

        chosen, rejected = mean("rewards_chosen", "desirable"), mean("rewards_rejected", "undesirable")
        return {
            "rewards_chosen": chosen,
            "rewards_rejected": rejected,
            "margin": None if chosen is None or rejected is None else chosen - rejected,
            "logps_chosen": mean("logps_chosen", "desirable"),
            "logps_rejected": mean("logps_rejected", "undesirable"),
        }

    def units(self, counts: torch.Tensor, desirable: torch.Tensor | None) -> torch.Tensor:
        """The pairs (KTO: answers) among a micro-batch's sequences, each with labels: its share of
        what the step's loss is divided by (`distft.train.step.normaliser`)."""
        n = len(desirable) if self.objective == "kto" else self.pairs_in(counts)
        return (counts[:n] > 0).sum()

    @staticmethod
    def pairs_in(logps: torch.Tensor) -> int:
        """Pairs among the sequences: 2B rows, or 2B documents and a packed row's fill after them."""
        return logps.shape[0] // 2

    def _record(self, reward_c, reward_r, chosen, rejected) -> None:
        margin = reward_c - reward_r
        self._add(
            torch.stack([reward_c, reward_r, (margin > 0).float(), margin, chosen, rejected]).sum(dim=1)
        )

    def _add(self, sums: torch.Tensor) -> None:
        sums = sums * self.share
        self.stats = sums if self.stats is None else self.stats + sums

    def take_stats(self, device: torch.device) -> torch.Tensor:
        """The sums since the last call (zeros if none), and start afresh."""
        stats, self.stats = self.stats, None
        return stats.float() if stats is not None else torch.zeros(len(STATS), device=device)


def preference_loss(objective: str, settings) -> PreferenceLoss | None:
    """The head of `train.objective` with its `[dpo]` settings (None: sft)."""
    if objective == "sft":
        return None
    return PreferenceLoss(
        objective, settings.beta, settings.loss_type, settings.label_smoothing,
        settings.desirable_weight, settings.undesirable_weight,
    )  # fmt: skip
