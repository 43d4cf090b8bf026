"""What a model family is: the `Family` dataclass every family file fills in (`distft.model.families`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PretrainedConfig

from distft.config.choices import ATTENTION_PROJECTIONS, PROJECTION_NAMES

# The projections of a decoder layer every family here shares (`PROJECTION_NAMES`, in order):
# (module path, tensor-parallel style). Column: the weight is split on `out` (dim 0); row: on `in`
# (dim 1) (`distft.parallel.tensor_parallel`). Each block's last projection is its row-parallel one.
ROW_PARALLEL = ("o_proj", "down_proj")
PROJECTIONS: tuple[tuple[str, str], ...] = tuple(
    (
        f"{'self_attn' if name in ATTENTION_PROJECTIONS else 'mlp'}.{name}",
        "row" if name in ROW_PARALLEL else "column",
    )
    for name in PROJECTION_NAMES
)


@dataclass(frozen=True)
class Family:
    """One architecture family as transformers builds it."""

    name: str  # distft's name, also transformers' `model_type`
    title: str  # for people: "Llama 3 / 3.1 / 3.2"
    config_class: type[PretrainedConfig]
    qk_norm: bool  # q_norm / k_norm: RMSNorm over each head of q and k
    qkv_bias: bool  # q_proj, k_proj and v_proj carry a bias
    # A mixture of experts: each layer's MLP is a router and a stack of experts, their projections
    # fused into two parameters per layer (`distft.model.families.qwen3_moe`), not Linear layers.
    moe: bool = False
    # What every checkpoint of the family shares, for the random presets (rope, eps, activation).
    defaults: dict = field(default_factory=dict)
    # Positions a config declares -> the context it was pretrained on, where they differ: what RoPE
    # scaling multiplies (`distft.model.positions`).
    pretrained_context: dict[int, int] = field(default_factory=dict)

    @property
    def biased(self) -> tuple[str, ...]:
        """Projection names that carry a bias."""
        return ("q_proj", "k_proj", "v_proj") if self.qkv_bias else ()

    def build_config(self, **fields) -> PretrainedConfig:
        """A config of this family: its defaults, then `fields` on top."""
        return self.config_class(**{**self.defaults, **fields})
