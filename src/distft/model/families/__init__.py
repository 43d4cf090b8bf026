"""Model families: what distft needs to know of an architecture, one file per family.

A `Family` says what a decoder layer of the architecture holds, as transformers builds it:
which projections (and which of them carry a bias), whether q and k are RMS-normalised per head,
whether long sequences meet a sliding window, and the config class random presets are built
from. Everything that depends on the architecture reads it from here: the presets
(`distft.model.presets`), the runtime's checks before launch, the tensor-parallel plans (q/k norms
are partial-gradient parameters), the hand-written Megatron layers (biases, q/k norms) and the
planner's tensor list (`distft.plan.model_spec`).

What the four dense families differ in (every other piece, RMSNorm, SwiGLU MLP, rotary embeddings,
grouped KV heads, is shared):

| family  | q/k norm | q/k/v bias | tied embeddings      | rotary                 | sliding window       |
|---------|----------|------------|----------------------|------------------------|----------------------|
| qwen3   | yes      | no         | up to 4B             | theta 1e6              | off                  |
| llama   | no       | no         | 3.2 1B/3B only       | theta 5e5, llama3 scaling (3.1+) | none         |
| qwen2   | no       | yes        | up to 3B (Qwen2.5)   | theta 1e6              | off (use_sliding_window=false) |
| mistral | no       | no         | no                   | theta 1e6 (v0.3)       | 4096 in v0.1, none in v0.3 |

`qwen3_moe` is Qwen3's attention with a mixture of experts for the MLP (`Family.moe`): a router
and a stack of experts per layer, trained under the strategies whose spec runs "moe" (`distft.layout.SPECS`).

Another family is one file here (its `Family`) and one line in `FAMILIES`; docs/architecture.md
walks through it, and tests/parallel/test_families.py fails for a family without parity coverage.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from distft.errors import ConfigError
from distft.model.families import llama, mistral, qwen2, qwen3, qwen3_moe
from distft.model.families.family import PROJECTIONS, Family

__all__ = [
    "FAMILIES",
    "PROJECTIONS",
    "Family",
    "check_sequence_length",
    "family_of",
    "layer_types",
    "sliding_window",
]

# The registry: a new family is one file beside this one and one entry here.
FAMILIES: dict[str, Family] = {
    f.name: f for f in (qwen3.FAMILY, llama.FAMILY, qwen2.FAMILY, mistral.FAMILY, qwen3_moe.FAMILY)
}


def family_of(config: PretrainedConfig, model: str = "") -> Family:
    """The family of an architecture, or a ConfigError naming the ones distft trains."""
    model_type = getattr(config, "model_type", "")
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    name = f"{model} " if model else ""
    raise ConfigError(
        f"The model {name}is a {model_type or 'unknown'!r} architecture; distft trains the families "
        f"{', '.join(f'{f.name} ({f.title})' for f in FAMILIES.values())}. A new family is one file in "
        "distft/model/families (docs/architecture.md, 'Adding a model family')."
    )


def sliding_window(config: PretrainedConfig) -> int | None:
    """The attention window a config actually applies (None: every layer attends to all earlier
    positions). Qwen2 configs carry a window that `use_sliding_window=false` switches off."""
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return getattr(config, "sliding_window", None)


def check_sequence_length(config: PretrainedConfig, model: str, max_length: int) -> None:
    """Refuse, before launch, rows longer than an active sliding window: distft's attention masks
    (packed rows, the pipeline stages, the Megatron layers) are causal over the whole row, which is
    exact only while no row is longer than the window."""
    window = sliding_window(config)
    if window is not None and max_length > window:
        raise ConfigError(
            f"{model} attends through a sliding window of {window} tokens, and data.max_length={max_length} "
            f"is longer: distft's attention masks are causal over the whole row, exact only up to the window. "
            f"Set data.max_length={window} (or less)."
        )


def layer_types(config: PretrainedConfig) -> list[str]:
    """Each decoder layer's attention type, as transformers names it. Qwen3 and Qwen2 configs list
    them; Llama and Mistral have one kind for every layer (a Mistral window is checked against
    the row length before launch, `check_sequence_length`)."""
    return list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
