"""Model families: what distft needs to know of an architecture, one file per family.

A `Family` says what a decoder layer of the architecture holds, as transformers builds it:
which projections (and which of them carry a bias), whether q and k are RMS-normalised per head,
whether long sequences meet a sliding window, and the config class random presets are built
from. Everything that depends on the architecture reads it from here: the presets
(`distft.model.presets`), the runtime's checks before launch, the tensor-parallel plans (q/k norms
are partial-gradient parameters), the hand-written Megatron layers (biases, q/k norms), the
planner's tensor list (`distft.plan.model_spec`) and the exporter.

What the four families differ in (every other piece, RMSNorm, SwiGLU MLP, rotary embeddings,
grouped KV heads, is shared):

| family  | q/k norm | q/k/v bias | tied embeddings      | rotary                 | sliding window       |
|---------|----------|------------|----------------------|------------------------|----------------------|
| qwen3   | yes      | no         | up to 4B             | theta 1e6              | off                  |
| llama   | no       | no         | 3.2 1B/3B only       | theta 5e5, llama3 scaling (3.1+) | none         |
| qwen2   | no       | yes        | up to 3B (Qwen2.5)   | theta 1e6              | off (use_sliding_window=false) |
| mistral | no       | no         | no                   | theta 1e6 (v0.3)       | 4096 in v0.1, none in v0.3 |

A fifth family is one file here (its `Family`) and one line in `FAMILIES`; docs/architecture.md
walks through it, and tests/model/test_families.py fails for a family without parity coverage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PretrainedConfig

from distft.errors import ConfigError

# The projections of a decoder layer every family here shares: (module path, tensor-parallel style).
# Column: the weight is split on `out` (dim 0); row: on `in` (dim 1) (`distft.parallel.tensor_parallel`).
PROJECTIONS: tuple[tuple[str, str], ...] = (
    ("self_attn.q_proj", "column"),
    ("self_attn.k_proj", "column"),
    ("self_attn.v_proj", "column"),
    ("self_attn.o_proj", "row"),
    ("mlp.gate_proj", "column"),
    ("mlp.up_proj", "column"),
    ("mlp.down_proj", "row"),
)


@dataclass(frozen=True)
class Family:
    """One architecture family as transformers builds it."""

    name: str  # distft's name, also transformers' `model_type`
    title: str  # for people: "Llama 3 / 3.1 / 3.2"
    config_class: type[PretrainedConfig]
    qk_norm: bool  # q_norm / k_norm: RMSNorm over each head of q and k
    qkv_bias: bool  # q_proj, k_proj and v_proj carry a bias
    # What every checkpoint of the family shares, for the random presets (rope, eps, activation).
    defaults: dict = field(default_factory=dict)
    # Where a real checkpoint's released chat template ends an assistant turn (for the docs and
    # the end-of-turn check; the template itself comes from the model's directory).
    end_of_turn: str = ""

    @property
    def biased(self) -> tuple[str, ...]:
        """Projection names that carry a bias."""
        return ("q_proj", "k_proj", "v_proj") if self.qkv_bias else ()

    def build_config(self, **fields) -> PretrainedConfig:
        """A config of this family: its defaults, then `fields` on top."""
        return self.config_class(**{**self.defaults, **fields})


def _families() -> dict[str, Family]:
    from distft.model.families import llama, mistral, qwen2, qwen3

    return {f.FAMILY.name: f.FAMILY for f in (qwen3, llama, qwen2, mistral)}


FAMILIES: dict[str, Family] = _families()


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
