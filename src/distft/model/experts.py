"""How a mixture of experts' layer computes its experts: `model.experts_implementation`.

After the router, an MoE layer holds T tokens, each sent to its top k of E experts, and every
expert's weights stacked in two parameters, `gate_up_proj` (E, 2 x inter, hidden) and `down_proj`
(E, hidden, inter). transformers' experts class (`Qwen3MoeExperts`) is decorated with
`use_experts_implementation`: at every forward it reads its config's `_experts_implementation`
and runs one of

- `eager`: the class's own code, a Python loop over the experts that got a token. Each expert
  finds its rows (a one-hot mask over the T x k assignments), gathers them, runs its SwiGLU MLP
  on them with two `linear` calls and adds the weighted result back (`index_add_`). E small
  matmuls per layer, and on CUDA a host sync per expert (the loop reads the device's tensor).
- `grouped_mm`: the T x k (token, expert) rows sorted by expert once, the rows each expert takes
  counted (`histc`, then their cumulative offsets), and each projection one grouped matmul over
  the whole stack (`torch.nn.functional.grouped_mm`: expert e multiplies rows offs[e-1]:offs[e]);
  the outputs unsorted, weighted, and each token's k summed. On CUDA (SM80+) one grouped GEMM
  kernel per projection, no host sync and no per-expert launches; on the CPU torch's own grouped
  matmul (torch >= 2.9; transformers falls back to a loop of `mm` where it is missing).
- `batched_mm`: every (token, expert) row gets a copy of its expert's weights (`weight[ids]`,
  T k x 2 inter x hidden) and one `bmm` multiplies them all: no sort and no loop, at the price of
  materialising a weight matrix per row (and, in backward, scattering its gradient back).

- `grouped_lora` (distft's, what `auto` picks): `grouped_mm`'s sort and grouped matmuls, and
  - peft's LoRA on the stacks kept as its two factors. peft (`target_parameters`) parametrizes
    each stack as base + delta, so the three above read a merged copy of every expert's weights,
    made in each forward and kept for backward like an activation: per MoE layer the size of its
    experts (1.2 GB for one layer of Qwen3-30B-A3B in bf16, 58 GB over its 48). Here each
    projection is `rows @ W_e^T + scaling (rows @ A_e^T) @ B_e^T`, three grouped matmuls, and
    backward keeps the rank-r rows (r per routed row and stack) and a contiguous copy of each B
    (r/in of its stack, either way); merged only where that is fewer multiply-adds
    (`merges_delta`: experts narrower than about 6 r, as on a CPU-sized model).
  - the rows moved by gathers alone (`Dispatch`, `Combine`): the (token, choice) pairs permuted
    into expert order and back, where autograd's backward of a gather is a scatter-add (atomics
    on CUDA, several times a gather's time on a CPU).
  - SiLU fused with its product and the row's routing weight (`SwiGLU`): SiLU's output recomputed
    in backward, not kept; the weight applied before the down projection (linear: the same sum),
    I wide instead of h, so the expert's output is not kept for the weight's gradient either.
  - the factors read from peft's wrappers (`adapters_on_rows`), without the parametrization peft
    registers on each stack at every forward, which computes the merged stack once to check it.

All four compute the same sums in a different order: equal outputs and gradients up to float
rounding (tests/model/test_experts.py). `auto` is `grouped_lora`: `grouped_mm` was the fastest of
transformers' three on a CPU (`distft bench --experts`, docs/moe.md), and transformers' own
default when nothing is set.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from peft.tuners.lora.layer import ParamWrapper
from torch import nn
from transformers.activations import SiLUActivation
from transformers.integrations.moe import (
    ALL_EXPERTS_FUNCTIONS,
    _default_apply_gate,
    grouped_mm_experts_forward,
)
from transformers.integrations.moe import _grouped_linear as grouped_linear  # its grouped_mm dispatch

from distft.model.families import FAMILIES

STACKS = ("gate_up_proj", "down_proj")  # an experts module's two stacked parameters
GROUPED = "grouped_lora"  # distft's, registered beside transformers' three
AUTO = GROUPED  # model.experts_implementation=auto (docs/moe.md, "Grouped expert matmul")
Factors = tuple[torch.Tensor, torch.Tensor, float]  # LoRA's (B (E, out, r), A (E, r, in), scaling)


def grouped_projection(
    rows: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor, factors: Factors | None = None
) -> torch.Tensor:
    """Each expert's rows (consecutive, ending at `offsets`) times its weight, plus its LoRA delta:
    applied to the rows through the rank-r factors, or merged into the stack where that is fewer
    multiply-adds (`merges_delta`: experts far narrower than the rank's few dozen, as on a
    CPU-sized model)."""
    if factors is None:
        return grouped_linear(rows, weight, offsets)
    b, a, scaling = factors
    b = b.contiguous()  # peft's is a permuted view: the kernels would copy it per expert, backward too
    if merges_delta(rows.shape[0], *weight.shape, a.shape[1]):
        merged = torch.baddbmm(weight, b.to(weight.dtype), a.to(weight.dtype), alpha=scaling)
        return grouped_linear(rows, merged, offsets)
    rank = grouped_linear if a.shape[1] * a.element_size() % 16 == 0 else _loop_linear
    delta = rank(rank(rows, a, offsets), b, offsets)
    return grouped_linear(rows, weight, offsets) + scaling * delta


def merges_delta(rows: int, experts: int, out: int, inp: int, rank: int) -> bool:
    """Whether a stack's LoRA delta costs fewer multiply-adds merged (`W + s B A`, E out in r, then
    in backward the merged stack's gradient, rows out in, and the factors' from it, 2 E out in r)
    than applied to the rows (rows r (in + out) forward, twice that backward). Only where
    min(in, out) is below about 6 r: never at a real model's width, whose delta goes through the rows."""
    return 3 * experts * out * inp * rank + rows * out * inp < 3 * rows * rank * (inp + out)


def _loop_linear(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`grouped_linear` as transformers' loop of matmuls: torch's grouped kernel wants rows of a
    multiple of 16 bytes, which a rank of 4 in bf16 (or 5 in fp32) is not."""
    return torch.ops.transformers.grouped_mm_fallback(
        rows.to(weight.dtype), weight.transpose(-2, -1), offsets
    )


def grouped_lora_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """`grouped_experts` on the stacks as the module presents them: with no adapter on them, or
    with peft's merged into them where its own forward ran (the adapters' factors are read before,
    by `adapters_on_rows`); transformers' own grouped_mm where the layout is another (biases,
    transposed stacks, no gate) or its expert parallelism runs."""
    if not grouped_layout(self):
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    stacks = {name: (getattr(self, name), None) for name in STACKS}
    return grouped_experts(self, hidden_states, top_k_index, top_k_weights, stacks)


def grouped_layout(experts: nn.Module) -> bool:
    """Whether `grouped_experts` computes these experts: fused [gate; up] stacks in transformers'
    (E, out, in) layout, no biases or post-expert norm, and not transformers' expert parallelism."""
    plain = experts.has_bias or experts.is_transposed or not experts.has_gate or experts.has_post_expert_norm
    return not plain and not experts._is_expert_parallel


def grouped_experts(
    experts: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    stacks: dict[str, tuple[torch.Tensor, Factors | None]],
) -> torch.Tensor:
    """grouped_mm's sort by expert and grouped matmuls, the rows moved by gathers (`Dispatch`,
    `Combine`), each projection a `grouped_projection`, SiLU fused and each row's routing weight
    applied before the down projection (`gated`)."""
    sorted_experts, order, inverse, token_of_row = sort_by_expert(top_k_index)
    offsets = torch.cumsum(expert_counts(sorted_experts, experts.num_experts), dim=0, dtype=torch.int32)
    rows, row_weights = Dispatch.apply(hidden_states, top_k_weights, token_of_row, order, inverse)
    out = grouped_mlp(rows, offsets, stacks, lambda gate_up: gated(experts, gate_up, row_weights))
    return Combine.apply(out, token_of_row, inverse, top_k_index.shape[-1]).to(hidden_states.dtype)


def sort_by_expert(top_k_index: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The (token, choice) pairs by expert: each row's expert, their order, its inverse, each row's token."""
    sorted_experts, order = torch.sort(top_k_index.reshape(-1))
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return sorted_experts, order, inverse, order // top_k_index.shape[-1]


def grouped_mlp(
    rows: torch.Tensor,
    offsets: torch.Tensor,
    stacks: dict[str, tuple[torch.Tensor, Factors | None]],
    activation: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Every expert's gated MLP over its consecutive rows: gate/up, `activation` over the fused
    output, down, each projection a `grouped_projection` (also `fsdp+ep`'s local experts)."""
    gate_up = grouped_projection(rows, offsets, *stacks["gate_up_proj"])
    return grouped_projection(activation(gate_up), offsets, *stacks["down_proj"])


def read_adapters(experts: nn.Module) -> tuple[nn.Module, dict[str, Factors]] | None:
    """transformers' experts module under peft's parameter wrappers, and the factors of each
    wrapped stack's active adapter as peft computes them (`get_delta_factors`); none for a stack
    whose adapters are off (a preference loss's reference). None where peft's own forward must
    run: an adapter merged into its stack, or several active on one."""
    module, factors = experts, {}
    while isinstance(module, ParamWrapper):
        active = [adapter for adapter in module.active_adapters if adapter in module.lora_A]
        if module.merged or len(active) > 1:
            return None
        if active and not module.disable_adapters:
            b, a, scaling = module.get_delta_factors(active[0])
            if b.shape[1] != module.get_param().shape[1]:  # (E, out, r): the stack's (E, out, in) layout
                return None
            factors[module.parameter_name] = (b, a, scaling)
        module = module.base_layer
    return module, factors


def adapters_on_rows(
    wrapper: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    peft_forward: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """The outermost of peft's parameter wrappers' forward under grouped_lora: the experts computed
    with the adapters' factors read from the wrappers (`read_adapters`), without peft's
    parametrization, which at every forward registers each stack's merged copy and computes it
    once to check it (E out in r multiply-adds and a stack-sized transient that no experts path
    reads). Else peft's forward."""
    read = read_adapters(wrapper)
    if read is None or read[0].config._experts_implementation != GROUPED or not grouped_layout(read[0]):
        return peft_forward(hidden_states, top_k_index, top_k_weights)
    base, factors = read
    stacks = {name: (getattr(base, name), factors.get(name)) for name in STACKS}
    return grouped_experts(base, hidden_states, top_k_index, top_k_weights, stacks)


def read_adapters_directly(model: nn.Module) -> None:
    """Route each MoE layer's adapted experts through `adapters_on_rows` (on the instance, as
    expert parallelism replaces it with its own): a peft model, right after its wrappers are in."""
    for module in model.modules():
        wrapper = getattr(module, "experts", None)
        if isinstance(wrapper, ParamWrapper):
            wrapper.forward = functools.partial(adapters_on_rows, wrapper, peft_forward=wrapper.forward)


def expert_counts(sorted_experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert: `histc` on an accelerator, as transformers counts them (no host sync, which
    `bincount` has there), `bincount` on the CPU (five times faster)."""
    if sorted_experts.device.type == "cpu":
        return torch.bincount(sorted_experts, minlength=num_experts)
    ids = sorted_experts.float() if sorted_experts.device.type == "mps" else sorted_experts.int()
    return torch.histc(ids, bins=num_experts, min=0, max=num_experts - 1)


# The (token, choice) pairs are permuted into expert order (`order`) and back (`inverse`): every
# move of rows, forward and backward, is a gather, where autograd's own backward of a gather is a
# scatter-add (atomics on CUDA, and several times slower than a gather on a CPU). The routing
# weight multiplies a row before the down projection, which is linear: I wide instead of h, and
# the expert's h-wide output is then not kept for the weight's gradient.


class Dispatch(torch.autograd.Function):
    """Each token's hidden state copied to its k rows and each (token, choice)'s routing weight to
    its row, in expert order (row i: token `token_of_row[i]`, pair `order[i]`); backward gathers
    both gradients back into pair order, each token's k rows summed."""

    @staticmethod
    def forward(ctx, hidden, weights, token_of_row, order, inverse) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(inverse)
        ctx.k, ctx.weights_dtype = weights.shape[-1], weights.dtype
        ctx.set_materialize_grads(False)
        return hidden.index_select(0, token_of_row), weights.reshape(-1).index_select(0, order).to(
            hidden.dtype
        )

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor | None, grad_weights: torch.Tensor | None):
        (inverse,) = ctx.saved_tensors
        grad_hidden = grad_weights_pairs = None
        if grad_rows is not None and ctx.needs_input_grad[0]:
            grad_hidden = sum_choices(grad_rows.index_select(0, inverse), ctx.k)
        if grad_weights is not None and ctx.needs_input_grad[1]:
            grad_weights_pairs = grad_weights.index_select(0, inverse).view(-1, ctx.k).to(ctx.weights_dtype)
        return grad_hidden, grad_weights_pairs, None, None, None


class Combine(torch.autograd.Function):
    """The expert-ordered output rows (already weighted) back in pair order, a token's k summed:
    `Dispatch`'s adjoint. Backward copies each token's gradient to its k rows."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, token_of_row: torch.Tensor, inverse: torch.Tensor, k: int):
        ctx.save_for_backward(token_of_row)
        return sum_choices(rows.index_select(0, inverse), k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (token_of_row,) = ctx.saved_tensors
        return grad.index_select(0, token_of_row), None, None, None


def sum_choices(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Rows in pair order (a token's k consecutive) summed per token. Top-2 as one add: on a CPU a
    reduction over a middle dimension of 2 takes 3-4 times as long (at k = 8, as long as 7 adds)."""
    by_token = rows.view(-1, k, rows.shape[-1])
    return by_token[:, 0] + by_token[:, 1] if k == 2 else by_token.sum(dim=1)


class SwiGLU(torch.autograd.Function):
    """`silu(gate) * up` over the fused gate/up rows, times each row's routing weight where given,
    keeping only the two halves (and the weights) for backward: SiLU's output is recomputed there
    (one sigmoid) instead of kept, c I bytes less per routed row, and the weights' gradient comes
    from the same recomputation. Each half is kept contiguous: an elementwise op over a strided
    half of a row runs several times slower on a CPU."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, row_weights: torch.Tensor | None) -> torch.Tensor:
        gate, up = (half.contiguous() for half in gate_up.chunk(2, dim=-1))
        ctx.save_for_backward(gate, up, row_weights)
        out = nn.functional.silu(gate).mul_(up)
        return out if row_weights is None else out.mul_(row_weights[:, None])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        gate, up, row_weights = ctx.saved_tensors
        silu = nn.functional.silu(gate)
        grad_weights = torch.linalg.vecdot(grad * silu, up) if ctx.needs_input_grad[1] else None
        grad = grad * row_weights[:, None] if row_weights is not None else grad.clone()  # written in below
        grad_up = silu.mul_(grad)
        grad_gate = torch.ops.aten.silu_backward(grad.mul_(up), gate)  # d silu(g) / dg, in fp32 inside
        return torch.cat([grad_gate, grad_up], dim=-1), grad_weights


def gated(experts: nn.Module, gate_up: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:
    """The experts' gated activation, each row times its routing weight: the class's own
    (`_apply_gate`) where a family changes transformers' default, else `swiglu`."""
    if type(experts)._apply_gate is not _default_apply_gate:
        return experts._apply_gate(gate_up) * row_weights[:, None]
    return swiglu(experts.act_fn, gate_up, row_weights)


def swiglu(act_fn: nn.Module, gate_up: torch.Tensor, row_weights: torch.Tensor | None = None) -> torch.Tensor:
    """`act_fn(gate) * up` over the fused gate/up rows, times each row's routing weight where
    given: `SwiGLU` where the activation is SiLU."""
    if type(act_fn) in (nn.SiLU, SiLUActivation):
        return SwiGLU.apply(gate_up, row_weights)
    gate, up = gate_up.chunk(2, dim=-1)
    out = act_fn(gate) * up
    return out if row_weights is None else out * row_weights[:, None]


ALL_EXPERTS_FUNCTIONS.register(GROUPED, grouped_lora_experts_forward)


def experts_kernel(choice: str) -> str:
    """The implementation transformers is given for `model.experts_implementation=choice`."""
    return AUTO if choice == "auto" else choice


def is_moe(model: nn.Module) -> bool:
    """Whether the built causal LM is of a mixture-of-experts family (its config's model_type)."""
    family = FAMILIES.get(getattr(model.config, "model_type", ""))
    return family is not None and family.moe


def use_experts(model: nn.Module, choice: str) -> None:
    """Set `model.experts_implementation` on a freshly built causal LM: its config, which every
    layer's experts module holds and reads at each forward. A dense model has no experts: left as is
    (transformers refuses an explicit grouped_mm on a model whose classes do not dispatch)."""
    if is_moe(model):
        model.set_experts_implementation(experts_kernel(choice))


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """transformers' experts modules of `model` (under peft's parameter wrappers, if any): the
    modules whose forward the implementation picks, marked by what `use_experts_implementation`
    sets in their constructor."""
    return [m for m in model.modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "config")]


def implementations_in_effect(model: nn.Module) -> set[str]:
    """The implementations `model`'s experts run with, read where they read it (each module's
    config): one name when the setting reached every layer, none for a dense model."""
    return {m.config._experts_implementation for m in experts_modules(model)}
