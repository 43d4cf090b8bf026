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

- `grouped_lora` (distft's, what `auto` picks): `grouped_mm` with peft's LoRA on the stacks kept
  as its two factors. peft (`target_parameters`) parametrizes each stack as base + delta, so
  the three above read a merged copy of every expert's weights, made in each forward and kept
  for backward like an activation: per MoE layer the size of its experts (1.2 GB for one layer of
  Qwen3-30B-A3B in bf16, 58 GB over its 48). Here each projection is instead
  `rows @ W_e^T + scaling (rows @ A_e^T) @ B_e^T`, three grouped matmuls, and backward keeps the
  rank-r rows (2 r per routed row and layer) and a contiguous copy of each B (r/in of its stack).
  Without adapters on the experts (full finetuning, or LoRA on attention only) it is
  transformers' `grouped_mm`.

All four compute the same sums in a different order: equal outputs and gradients up to float
rounding (tests/model/test_experts.py). `auto` is `grouped_lora`: `grouped_mm` was the fastest of
transformers' three on a CPU (`distft bench --experts`, docs/moe.md), and transformers' own
default when nothing is set.
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import _LoraFactorsProxy
from torch import nn
from torch.nn.utils import parametrize
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward
from transformers.integrations.moe import _grouped_linear as grouped_linear  # its grouped_mm dispatch

from distft.model.families import FAMILIES

AUTO = "grouped_lora"  # model.experts_implementation=auto (docs/moe.md, "Grouped expert matmul")
Factors = tuple[torch.Tensor, torch.Tensor, float]  # LoRA's (B (E, out, r), A (E, r, in), scaling)


def lora_stack(experts: nn.Module, name: str) -> tuple[torch.Tensor, Factors | None]:
    """An expert stack (E, out, in) and, where peft's one active adapter parametrizes it, that
    adapter's factors, B contiguous as a grouped matmul wants it; (the stack as read, None) else."""
    if parametrize.is_parametrized(experts, name):
        chain = experts.parametrizations[name]
        if len(chain) == 1 and isinstance(chain[0], _LoraFactorsProxy):
            b, a, scaling = chain[0].lhs, chain[0].rhs, chain[0].scaling
            if b.shape[1] == chain.original.shape[1]:  # (E, out, r): the stack's own (E, out, in) layout
                # The frozen stack as data: peft re-registers its parametrization at every forward,
                # which bumps the parameter's version, and a pipeline runs several forwards before
                # the backward that reads it.
                weight = chain.original.data if not chain.original.requires_grad else chain.original
                return weight, (b.contiguous(), a, scaling)
    return getattr(experts, name), None


def grouped_projection(
    rows: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor, factors: Factors | None = None
) -> torch.Tensor:
    """Each expert's rows (consecutive, ending at `offsets`) times its weight, plus its LoRA delta
    applied to the rows through the rank-r factors: `W + scaling B A` is never formed."""
    out = grouped_linear(rows, weight, offsets)
    if factors is None:
        return out
    b, a, scaling = factors
    rank = grouped_linear if a.shape[1] * a.element_size() % 16 == 0 else _loop_linear
    return out + scaling * rank(rank(rows, a, offsets), b, offsets)


def _loop_linear(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`grouped_linear` as transformers' loop of matmuls: torch's grouped kernel wants rows of a
    multiple of 16 bytes, which a rank of 4 in bf16 (or 5 in fp32) is not."""
    return torch.ops.transformers.grouped_mm_fallback(
        rows.to(weight.dtype), weight.transpose(-2, -1), offsets
    )


def grouped_lora_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' grouped_mm experts forward, each projection a `grouped_projection`; theirs
    where no adapter sits on the stacks or the layout is another (biases, transposed stacks)."""
    stacks = {name: lora_stack(self, name) for name in ("gate_up_proj", "down_proj")}
    plain = self.has_bias or self.is_transposed or not self.has_gate or self.has_post_expert_norm
    if plain or self._is_expert_parallel or all(f is None for _, f in stacks.values()):
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    k = top_k_index.shape[-1]
    experts, order = torch.sort(top_k_index.reshape(-1))  # each token's k rows, grouped by expert
    # histc, as transformers counts them: no host sync; deterministic on floats (CPU), ints (CUDA)
    ids = experts.float() if experts.device.type in ("cpu", "mps") else experts.int()
    counts = torch.histc(ids, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    out = grouped_projection(hidden_states[order // k], offsets, *stacks["gate_up_proj"])
    out = grouped_projection(self._apply_gate(out), offsets, *stacks["down_proj"])
    out = out * top_k_weights.reshape(-1)[order, None]
    unsort = torch.empty_like(order)
    unsort[order] = torch.arange(order.numel(), device=order.device)
    return out[unsort].view(-1, k, out.shape[-1]).sum(dim=1).to(hidden_states.dtype)


ALL_EXPERTS_FUNCTIONS.register("grouped_lora", grouped_lora_experts_forward)


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
