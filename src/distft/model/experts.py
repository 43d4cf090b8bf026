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

All three compute the same sums in a different order: equal outputs and gradients up to float
rounding (tests/model/test_experts.py). peft's LoRA on the experts (`target_parameters`) works
under each: it parametrizes the stacked weight (base + the experts' stacked deltas), which every
path reads whole. `auto` is `grouped_mm`, the fastest of the three measured on a CPU
(`distft bench --experts`, docs/moe.md), and transformers' own default when nothing is set.
"""

from __future__ import annotations

from torch import nn

from distft.model.families import FAMILIES

AUTO = "grouped_mm"  # model.experts_implementation=auto (docs/moe.md, "Grouped expert matmul")


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
