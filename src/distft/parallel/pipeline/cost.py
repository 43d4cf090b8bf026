"""What a pipeline stage costs, in modelled FLOPs, and the cut of the layers that balances the stages.

A stage is a contiguous run of decoder layers; stage 0 also holds the embedding, the last stage the
final norm, lm_head and the loss. Cut by layer count (`even_cut`), the last stage carries the head
on top of its share: on Qwen3-4B with every position labelled the head is ~3.4 of its 36 layers,
and on the CPU presets (hidden 32 or 64, vocabulary 151,936) it outweighs every layer together.

**The cost of a piece**, per sequence of t positions of which k carry a label, split into the
three passes a pipeline schedules: F (forward), B (backward: the input gradient, which the previous
stage waits for) and W (the weight gradient, which nobody waits for). The convention is
`distft.measure.flops`'s (PaLM, 2204.02311, appendix B): only matrix multiplies count, and a
multiply-add is 2 FLOPs.

- A weight of N elements (`matmul`): F = 2Nt, B = 2Nt, and W = 2Nt if it trains, else nothing.
  A frozen base costs 4Nt (LoRA, QLoRA), a trained weight 6Nt (full finetuning).
- LoRA on a projection (out, in), rank r: two trained weights, r x in and out x r: 6 r (in + out) t.
- Attention's two matmuls (Q K^T, then the probabilities times V; `attention`): 2 s t d_attn each
  forward, halved by the causal mask, so F = 2 t^2 d_attn per layer and sequence; their backward
  has twice the matmuls and no weights: B = 4 t^2 d_attn, W = 0 (d_attn = heads x head_dim).
- The head: lm_head (hidden x vocab) runs on the labelled positions only
  (`distft.model.lm.summed_loss`), so it costs c_head x hidden x vocab x k, c_head = 6 if it trains
  (full finetuning) else 4. Whether it is tied to the embedding changes memory, not FLOPs.
- The final norm (`norm`): elementwise over (t, hidden), counted roughly as F = 4, B = 6 and, when
  it trains, W = 2 FLOPs per element: small beside any matmul, and nothing rests on it.
- The embedding: 0. A lookup computes nothing; its forward copies t x hidden elements, less than
  the elementwise work inside one decoder layer (two norms, rotary, SwiGLU, residual adds), which
  the convention does not count either. Charging the lookup alone would only tilt stage 0.

Left out: elementwise work inside the layers (a few percent at real widths), QLoRA's
dequantisation, DoRA's magnitudes, the messages between stages, and the fixed overhead of each
pass (large on a small CPU model). `balanced_cut` takes any per-layer costs, so costs measured per
pass can replace the modelled ones.

**The balanced cut** (`balanced_cut`): of all cuts of the L layers into S contiguous stages of at
least one layer, the one whose slowest stage (layers plus the embedding or the head it holds) costs
least; among those, the closest to the even cut (least sum over stages of |layers - even layers|),
then the one with fewer layers early (the smallest tuple). Found exactly by dynamic programming
over (stages placed, layers placed): first the least achievable slowest stage, then, among the
cuts within it, the least distance to even, built from the last stage back so the forward walk can
pick the smallest tuple. Costs are compared as `math.fsum` of the pieces, so any two ways of adding
up a stage give the same float and an exhaustive search agrees with it exactly
(tests/parallel/test_pipeline_cost.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from distft.config import PROJECTION_NAMES, Config, lora_target_names
from distft.model.nf4 import projection_shapes

MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # an MoE's: each expert's, top-k per token

# Labelled positions per sequence when the data is not known (the planner's `Training.label_tokens`,
# capped at the sequence): the runtime measures the training split's mean instead.
DEFAULT_LABEL_TOKENS = 256
# The final RMSNorm per element of (tokens, hidden): square, mean, scale, weight forward; about
# half again for the input gradient; one multiply-add for the weight's (rough: nothing rests on it).
NORM_FLOPS = (4, 6, 2)


@dataclass(frozen=True)
class PassCost:
    """FLOPs of one piece of the model over one sequence, by pass: F, B (input gradient), W (weight gradient)."""

    forward: float = 0
    input_grad: float = 0
    weight_grad: float = 0

    @property
    def total(self) -> float:
        return self.forward + self.input_grad + self.weight_grad

    def __add__(self, other: PassCost) -> PassCost:
        return PassCost(
            self.forward + other.forward,
            self.input_grad + other.input_grad,
            self.weight_grad + other.weight_grad,
        )


def matmul(weights: int, trains: bool, tokens: float) -> PassCost:
    """A weight of `weights` elements applied to `tokens` positions (2 FLOPs per multiply-add)."""
    once = 2 * weights * tokens
    return PassCost(once, once, once if trains else 0)


def attention(attn_dim: int, tokens: int) -> PassCost:
    """Causal attention's two matmuls over one sequence of `tokens` positions (no weights)."""
    return PassCost(2 * tokens * tokens * attn_dim, 4 * tokens * tokens * attn_dim, 0)


def norm(hidden: int, trains: bool, tokens: float) -> PassCost:
    """An RMSNorm over (tokens, hidden): elementwise, `NORM_FLOPS` per element."""
    f, b, w = (n * hidden * tokens for n in NORM_FLOPS)
    return PassCost(f, b, w if trains else 0)


def layer_weights(
    config, method: str = "lora", lora_rank: int = 16, lora_targets: Sequence[str] = PROJECTION_NAMES
) -> tuple[int, int]:
    """(frozen, trained) weights in one decoder layer's matmuls of `config` trained by `method`:
    full finetuning trains every projection; LoRA freezes them and trains r x (in + out) more on
    each target (lora_A (r, in) and lora_B (out, r)). Elementwise weights (norms, biases, DoRA's
    magnitudes) are not matmuls and are not counted.

    A mixture of experts counts what a token computes with: its top-k experts' MLPs (and their
    adapters; gate and up share one lora_A, the fused stack's) and the whole router, as a run's
    `ModelFlops` counts them."""
    full = method == "full"
    targets = set() if full or not lora_targets else set(lora_target_names(list(lora_targets)))
    experts, top_k = getattr(config, "num_experts", 0) or 0, getattr(config, "num_experts_per_tok", 0)
    frozen = trained = 0
    for name, (out, inp) in projection_shapes(config).items():  # Linear weight: (out, in)
        active = top_k if experts and name in MLP_PROJECTIONS else 1
        if full:
            trained += active * out * inp
        else:
            frozen += active * out * inp
        if name in targets:
            shared_input = experts and name == "up_proj"  # gate_up's one lora_A is counted with gate
            trained += active * lora_rank * (out if shared_input else inp + out)
    if experts:  # the router: (experts, hidden), frozen under LoRA
        router = experts * config.hidden_size
        frozen, trained = (frozen, trained + router) if full else (frozen + router, trained)
    return frozen, trained


def layers_cost(frozen: int, trained: int, attn_dim: int, tokens: float, layers: int = 1) -> PassCost:
    """`layers` decoder layers over one sequence: their matmuls (`frozen` and `trained` weights, all
    layers together) and each layer's causal attention (`layer_weights`, `attention_dim`)."""
    # Attention is linear in d_attn: L layers' is one of L x d_attn.
    return (
        matmul(frozen, False, tokens) + matmul(trained, True, tokens) + attention(layers * attn_dim, tokens)
    )


def attention_dim(config) -> int:
    """d_attn = heads x head_dim (head_dim, where the config has none, hidden / heads)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads * head_dim


@dataclass(frozen=True)
class CostModel:
    """Modelled FLOPs per sequence of every piece a stage can hold (the module docstring)."""

    layers: tuple[PassCost, ...]  # decoder layer i
    first: PassCost  # stage 0's extra: the embedding
    last: PassCost  # the last stage's extra: final norm, lm_head and loss
    tokens: int = 0  # positions per sequence (t)
    label_tokens: float = 0  # of them labelled (k)
    notes: dict = field(default_factory=dict, compare=False)  # what the figures came from

    @classmethod
    def from_config(
        cls,
        config,  # a transformers config, or anything with its size fields (the planner's `ModelSpec`)
        method: str = "lora",
        lora_rank: int = 16,
        lora_targets: Sequence[str] = PROJECTION_NAMES,
        tokens: int = 2048,
        label_tokens: float | None = None,
    ) -> CostModel:
        """The model of a dense decoder of `config`'s sizes trained by `method` on sequences of
        `tokens` positions, `label_tokens` of them labelled (None: `DEFAULT_LABEL_TOKENS`, capped)."""
        k = min(DEFAULT_LABEL_TOKENS, tokens) if label_tokens is None else min(label_tokens, tokens)
        full = method == "full"
        layer = layers_cost(
            *layer_weights(config, method, lora_rank, lora_targets), attention_dim(config), tokens
        )
        head = matmul(config.hidden_size * config.vocab_size, full, k)
        last = norm(config.hidden_size, full, tokens) + head
        notes = {"method": method, "lora_rank": lora_rank if not full else None}
        return cls((layer,) * config.num_hidden_layers, PassCost(), last, tokens, k, notes)

    @classmethod
    def for_run(cls, cfg: Config, model_config, label_tokens: float | None = None) -> CostModel:
        """The model of a run: `cfg`'s method and LoRA settings, rows of data.max_length positions
        (a pipeline pads every row to it), `label_tokens` labelled (measured on the data)."""
        return cls.from_config(
            model_config,
            cfg.train.method,
            cfg.lora.rank,
            cfg.lora.target_modules,
            cfg.data.max_length,
            label_tokens,
        )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_costs(self) -> list[float]:
        return [layer.total for layer in self.layers]

    def stage_costs(self, cut: Sequence[int]) -> list[float]:
        """Each stage's modelled cost (all three passes) under `cut`, layers per stage."""
        return stage_costs(cut, self.layer_costs(), self.first.total, self.last.total)

    def stage_passes(self, cut: Sequence[int]) -> list[PassCost]:
        """Each stage's F, B and W under `cut`."""
        out, start = [], 0
        for s, n in enumerate(cut):
            cost = self.first if s == 0 else PassCost()
            for layer in self.layers[start : start + n]:
                cost += layer
            out.append(cost + self.last if s == len(cut) - 1 else cost)
            start += n
        return out

    def balanced_cut(self, stages: int) -> tuple[int, ...]:
        return balanced_cut(self.layer_costs(), stages, self.first.total, self.last.total)

    def describe(self) -> dict:
        """The figures ranks.json and the timeline record: per sequence, in FLOPs."""
        return {
            "tokens_per_sequence": self.tokens,
            "label_tokens_per_sequence": self.label_tokens,
            "layer_flops": self.layer_costs(),
            "embedding_flops": self.first.total,
            "head_flops": self.last.total,  # final norm, lm_head on the labelled positions, loss
            **self.notes,
        }


# ---- cuts ---------------------------------------------------------------------------------------


def even_cut(num_layers: int, stages: int) -> tuple[int, ...]:
    """Layers per stage balanced by count: the first num_layers mod stages stages take one more."""
    base, extra = divmod(num_layers, stages)
    return tuple(base + (s < extra) for s in range(stages))


def stage_cost(layer_costs: Sequence[float], start: int, stop: int, head: float, tail: float) -> float:
    """One stage's cost: layers [start, stop) plus `head` (stage 0's embedding) and `tail` (the
    last stage's head), added exactly (`math.fsum`), so the order of addition never matters."""
    return math.fsum([head, *layer_costs[start:stop], tail])


def stage_costs(
    cut: Sequence[int], layer_costs: Sequence[float], first: float = 0.0, last: float = 0.0
) -> list[float]:
    """Every stage's cost under `cut`: its layers', plus `first` on stage 0 and `last` on the last."""
    out, start = [], 0
    for s, n in enumerate(cut):
        extras = (first if s == 0 else 0.0, last if s == len(cut) - 1 else 0.0)
        out.append(stage_cost(layer_costs, start, start + n, *extras))
        start += n
    return out


def imbalance(costs: Sequence[float]) -> float:
    """Slowest over mean: 1 for equal stages; the bubble formula assumes 1."""
    return max(costs) / (math.fsum(costs) / len(costs))


def balanced_cut(
    layer_costs: Sequence[float], stages: int, first: float = 0.0, last: float = 0.0
) -> tuple[int, ...]:
    """Layers per stage of the contiguous cut that minimises the slowest stage's cost, the closest
    to even among those, then the smallest tuple (the module docstring). `layer_costs`: each
    decoder layer's cost; `first`, `last`: what stage 0 and the last stage hold besides layers.
    Modelled (`CostModel`) or measured costs alike."""
    return _balanced_cut(tuple(layer_costs), stages, first, last)


@functools.lru_cache(maxsize=256)  # the planner asks for the same cut once per rank and per figure
def _balanced_cut(layer_costs: tuple[float, ...], stages: int, first: float, last: float) -> tuple[int, ...]:
    n, S = len(layer_costs), stages
    if not 1 <= S <= n:
        raise ValueError(f"cannot cut {n} layers into {S} stages of at least one layer")
    costs: dict[tuple[int, int, int], float] = {}

    def cost(s: int, i: int, j: int) -> float:  # stage s holding layers [i, j)
        if (s, i, j) not in costs:
            costs[s, i, j] = stage_cost(
                layer_costs, i, j, first if s == 0 else 0.0, last if s == S - 1 else 0.0
            )
        return costs[s, i, j]

    # 1. least[s][j]: the least slowest stage of stages 0..s-1 holding layers 0..j-1. Stage s-1
    # starts at i >= s-1 (one layer per earlier stage) and leaves a layer to each later one.
    least = [[math.inf] * (n + 1) for _ in range(S + 1)]
    least[0][0] = 0.0
    for s in range(1, S + 1):
        for j in range(s, n - (S - s) + 1):
            least[s][j] = min(max(least[s - 1][i], cost(s - 1, i, j)) for i in range(s - 1, j))
    bound = least[S][n]
    # 2. distance[s][i]: the least distance to even of stages s..S-1 holding layers i..n-1, every
    # stage within the bound.
    even = even_cut(n, S)
    distance = [[math.inf] * (n + 1) for _ in range(S + 1)]
    distance[S][n] = 0
    for s in range(S - 1, -1, -1):
        for i in range(s, n - (S - s) + 1):
            distance[s][i] = min(
                (
                    abs(j - i - even[s]) + distance[s + 1][j]
                    for j in range(i + 1, n - (S - s - 1) + 1)
                    if cost(s, i, j) <= bound
                ),
                default=math.inf,
            )
    # 3. Forward, each stage as few layers as keep both optima.
    cut, i = [], 0
    for s in range(S):
        j = next(
            j
            for j in range(i + 1, n - (S - s - 1) + 1)
            if cost(s, i, j) <= bound and abs(j - i - even[s]) + distance[s + 1][j] == distance[s][i]
        )
        cut.append(j - i)
        i = j
    return tuple(cut)


# ---- the replay's pass times ------------------------------------------------------------------


def pass_times(passes: Sequence[PassCost], split_backward: bool) -> dict[tuple[int, str], float]:
    """Each stage's modelled F, B (and W) for `distft.measure.pipeline.replay`, in FLOPs.

    The stage's whole cost is split 1:2 between forward and backward, whatever its FLOPs say: on
    this CPU a backward takes about twice its forward even under LoRA (docs/pp.md: 47 and 91 ms on
    tiny's stage 0), where the frozen base's FLOPs alone would say 1:1. Under zero-bubble and zbv
    the backward splits between B and W as the FLOPs of input and weight gradients do; stage 0
    passes no input gradient on, and torch runs its whole backward as W (B takes no time).
    """
    out = {}
    for s, p in enumerate(passes):
        forward, backward = p.total / 3, 2 * p.total / 3
        out[s, "F"] = forward
        if not split_backward:
            out[s, "B"] = backward
            continue
        grads = p.input_grad + p.weight_grad
        weight = backward if s == 0 else backward * (p.weight_grad / grads if grads else 0.0)
        out[s, "B"], out[s, "W"] = backward - weight, weight
    return out
