"""The router's auxiliary losses of a mixture of experts, and its per-expert token counts.

A router trained on the language-model loss alone tends to collapse onto a few experts: they get
the tokens, so they train, so they get more tokens. Two auxiliary losses on each layer's router
logits `z` (tokens, experts) keep it spread and tame:

- **load balancing** (Switch Transformer, eqs. 4-6; what transformers adds to Qwen3-MoE's loss when
  `output_router_logits` is set, `load_balancing_loss_func`, which this calls):
  `E * sum_e f_e * P_e`, with `f_e` the share of top-k assignments that went to expert `e` and
  `P_e` its mean router probability, pooled over the layers. Balanced routing gives `top_k`;
  collapse onto `top_k` experts gives `E`.
- **z-loss** (ST-MoE, eq. 5): the mean over tokens and layers of `logsumexp(z)^2`, which keeps the
  logits small enough for a bf16 softmax.

Each layer's router output is caught by a forward hook while `LossLM` runs its forward with
gradients (not the reference's forward under disabled adapters, an evaluation, or the recompute
of activation checkpointing, which all run without the hook's flag or without gradients). The
micro-batch's objective then adds `units x (moe.aux_loss_coef x aux + moe.z_loss_coef x z)`, `units`
being its share of what the step's loss is divided by (labelled tokens, or pairs), so that the
step's loss is the language-model mean plus the coefficients times the unit-weighted mean of the
micro-batches' auxiliary losses, as transformers computes it for one micro-batch.

Where no rank sees every layer and token, the pooled means are rebuilt from sums that add up
(`layer_sums`: each expert's router probability and assignments, `logsumexp(z)^2`, the rows): a
pipeline's stages pass theirs on beside the hidden states and the last stage forms the losses
(`pooled_term`); context parallel ranks all-reduce theirs and each keeps the gradient of its own
tokens' share (`split_term`). Either way the losses, and their gradients, are one process's.

The term joins the returned loss as `term - term.detach()`: zero in value, its gradient intact.
The loss the run reports stays the language model's (comparable with `eval_loss` and with a dense
model's), and metrics.jsonl records the auxiliary losses beside it (`router_aux_loss`,
`router_z_loss`), with the tokens each expert took (`expert_tokens`, a token counting at each of
its top-k experts, summed over the layers) and the worst layer's imbalance (`expert_imbalance`,
its busiest expert's tokens over the mean).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

STATS = ("router_aux_loss", "router_z_loss")


def routers(backbone: nn.Module) -> list[nn.Module]:
    """Each decoder layer's router (`mlp.gate` beside `mlp.experts`); none on a dense model."""
    return [
        layer.mlp.gate
        for layer in backbone.layers
        if hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "gate")
    ]


class RouterLosses:
    """Catches the routers' outputs during a training forward and turns them into the auxiliary
    losses' term of the micro-batch (`term`) and the step's statistics (`take_stats`)."""

    def __init__(self, gates: list[nn.Module], aux_loss_coef: float, z_loss_coef: float):
        self.num_experts, self.top_k = gates[0].num_experts, gates[0].top_k
        self.num_layers = len(gates)
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.collecting = False  # on during a training forward (`catching`)
        self.caught: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (layer, logits, top-k indices)
        self.sums: torch.Tensor | None = None
        for layer, gate in enumerate(gates):
            gate.register_forward_hook(functools.partial(self._catch, layer))

    def _catch(self, layer: int, module: nn.Module, args, output: tuple[torch.Tensor, ...]) -> None:
        if self.collecting and torch.is_grad_enabled():
            logits, _, indices = output
            self.caught.append((layer, logits, indices))

    @contextlib.contextmanager
    def catching(self) -> Iterator[None]:
        """Catch the routers' outputs of the forward run inside (LossLM's, a pipeline stage's, a
        context-parallel rank's), for `term`, `layer_sums` or `split_term` to take after it."""
        self.collecting = True
        try:
            yield
        finally:
            self.collecting = False

    @property
    def trains(self) -> bool:
        """Whether the auxiliary losses have a weight (else they are only recorded)."""
        return bool(self.aux_loss_coef or self.z_loss_coef)

    def term(self, units: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """`units x (aux_coef x aux + z_coef x z)` for the forward just run, as a zero-valued
        tensor carrying its gradient; None when no router ran with gradients."""
        caught, self.caught = self.caught, []
        if not caught:
            return None
        logits = [z if self.trains else z.detach() for _, z, _ in caught]
        mask = None if attention_mask is None else attention_mask.reshape(-1).float()
        aux = load_balancing_loss_func(tuple(logits), self.num_experts, self.top_k, attention_mask)
        lse = torch.logsumexp(torch.stack(logits).float(), dim=-1)  # (layers, tokens)
        tokens = lse.shape[1] if mask is None else mask.sum()
        z_loss = (lse.square() * (1 if mask is None else mask)).sum() / (tokens * self.num_layers)
        self._record(aux, z_loss, units)
        self._count(caught, mask)
        return self._weighted(aux, z_loss, units)

    def layer_sums(self, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """What the losses pool over the layers, summed over the layers the forward just ran (a
        pipeline stage's, `distft.parallel.pipeline.stages`): each expert's router probability
        (E, with its gradient), its top-k assignments (E), `logsumexp(z)^2` and the rows, the
        padding left out. Sums of two stages add up; `pooled_term` takes the whole model's."""
        caught, self.caught = self.caught, []
        mask = None if attention_mask is None else attention_mask.reshape(-1).float()
        parts = []
        for _, logits, chosen in caught:
            z = (logits if self.trains else logits.detach()).float()
            weight = torch.ones(z.shape[0], device=z.device) if mask is None else mask
            picks = torch.zeros(self.num_experts, device=z.device)
            picks.scatter_add_(0, chosen.reshape(-1), weight.repeat_interleave(self.top_k))
            probs = (z.softmax(dim=-1) * weight[:, None]).sum(dim=0)
            lse2 = (torch.logsumexp(z, dim=-1).square() * weight).sum()
            parts.append(torch.cat([probs, picks, lse2[None], weight.sum()[None]]))
        self._count(caught, mask)
        return torch.stack(parts).sum(dim=0)

    def pooled_term(self, sums: torch.Tensor, units: torch.Tensor) -> torch.Tensor | None:
        """`term` from every layer's `layer_sums`: the same losses as transformers pools them,
        gradients flowing back through each stage's probabilities; None without gradients."""
        if not torch.is_grad_enabled():
            return None
        e = self.num_experts
        probs, picks, lse2, rows = sums[:e], sums[e : 2 * e].detach(), sums[2 * e], sums[2 * e + 1].detach()
        aux = e * (picks / rows * probs / rows).sum()
        z_loss = lse2 / rows
        self._record(aux, z_loss, units)
        return self._weighted(aux, z_loss, units)

    def split_term(self, units: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor | None:
        """`term` where each rank of `group` ran every layer on its own share of each row's tokens
        (context parallelism; `weight` (batch, tokens): 1 for this rank's real tokens, 0 for
        padding and fill). The pooled counts and rows are summed over the ranks (one all-reduce of
        the `layer_sums`, their value only); each rank's term carries the gradient of its own
        probabilities and logsumexps against them, and the ranks' terms sum to the whole one."""
        if not torch.is_grad_enabled():
            return None
        mine = self.layer_sums(weight)
        total = mine.detach().clone()
        dist.all_reduce(total, group=group)
        e, share = self.num_experts, 1 / dist.get_world_size(group)
        picks, rows = total[e : 2 * e], total[2 * e + 1]
        self._record(e * (picks / rows * total[:e] / rows).sum(), total[2 * e] / rows, units * share)
        return self._weighted(e * (picks / rows * mine[:e] / rows).sum(), mine[2 * e] / rows, units)

    def _weighted(self, aux: torch.Tensor, z_loss: torch.Tensor, units: torch.Tensor) -> torch.Tensor | None:
        if not self.trains:
            return None
        objective = units * (self.aux_loss_coef * aux + self.z_loss_coef * z_loss)
        return objective - objective.detach()

    @torch.no_grad()
    def _record(self, aux: torch.Tensor, z_loss: torch.Tensor, units: torch.Tensor) -> None:
        units = units.float()
        self._add(torch.stack([aux.float() * units, z_loss.float() * units, units]), 0)

    @torch.no_grad()
    def _count(self, caught: list[tuple[int, torch.Tensor, torch.Tensor]], mask: torch.Tensor | None) -> None:
        """Each caught layer's top-k assignments per expert, the padding left out."""
        counts = torch.zeros(self.num_layers, self.num_experts, device=caught[0][2].device)
        for layer, _, chosen in caught:  # (tokens, top_k) each
            weight = (
                torch.ones_like(chosen, dtype=counts.dtype)
                if mask is None
                else mask[:, None].expand_as(chosen)
            )
            counts[layer].scatter_add_(0, chosen.reshape(-1), weight.reshape(-1))
        self._add(counts.reshape(-1), 3)

    def _add(self, values: torch.Tensor, at: int) -> None:
        if self.sums is None:
            self.sums = torch.zeros(self.size, device=values.device)
        self.sums[at : at + values.numel()] += values

    def take_stats(self, device: torch.device) -> torch.Tensor:
        """The sums since the last call (zeros if none), and start afresh: the unit-weighted
        auxiliary losses, the units, and each layer's per-expert token counts."""
        sums, self.sums = self.sums, None
        return sums if sums is not None else torch.zeros(self.size, device=device)

    @property
    def size(self) -> int:
        """The length of `take_stats`'s sums."""
        return 3 + self.num_layers * self.num_experts

    def means(self, sums: list[float]) -> dict[str, float | list[int]]:
        """The step's record from its sums over the ranks (`take_stats`)."""
        aux, z_loss, units, *flat = sums
        counts = torch.tensor(flat).reshape(self.num_layers, self.num_experts)
        busiest = counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-9)
        return {
            "router_aux_loss": aux / units if units else None,
            "router_z_loss": z_loss / units if units else None,
            "expert_tokens": [round(c) for c in counts.sum(dim=0).tolist()],
            "expert_imbalance": busiest.max().item() if units else None,
        }


def catching(router: RouterLosses | None) -> contextlib.AbstractContextManager:
    """`router.catching()`, or nothing for a dense model (a forward without gradients catches
    nothing either: `RouterLosses` looks as each router runs)."""
    return router.catching() if router is not None else contextlib.nullcontext()


def router_losses(backbone: nn.Module, aux_loss_coef: float, z_loss_coef: float) -> RouterLosses | None:
    """The auxiliary losses of the model's routers (`[moe]`), hooked on them; None on a dense model."""
    gates = routers(backbone)
    return RouterLosses(gates, aux_loss_coef, z_loss_coef) if gates else None
