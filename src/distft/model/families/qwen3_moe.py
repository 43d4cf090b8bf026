"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's attention, and a mixture of experts in place of the MLP.

Each decoder layer's MLP is `Qwen3MoeSparseMoeBlock`: a router (`mlp.gate`, one (experts, hidden)
weight) scores every token against every expert, keeps the top `num_experts_per_tok` (8 of 128 in
30B-A3B), renormalises their probabilities (`norm_topk_prob`), and sums those experts' SwiGLU MLPs,
weighted. transformers holds the experts fused, two parameters per layer: `mlp.experts.gate_up_proj`
(experts, 2 x moe_intermediate, hidden) and `mlp.experts.down_proj` (experts, hidden,
moe_intermediate). Every expert's weights are held; a token computes with its top-k only, so
30B-A3B holds 30.5B parameters and runs 3.3B per token. LoRA reaches the experts through peft's
parameter targeting (`distft.model.build.lora_config`): one adapter per expert, stacked.
"""

from transformers import Qwen3MoeConfig

from distft.model.families.family import Family
from distft.model.families.qwen3 import FAMILY as QWEN3

FAMILY = Family(
    name="qwen3_moe",
    title="Qwen3-MoE",
    config_class=Qwen3MoeConfig,
    qk_norm=True,
    qkv_bias=False,
    moe=True,
    defaults={**QWEN3.defaults, "norm_topk_prob": True, "router_aux_loss_coef": 0.001},
    pretrained_context=QWEN3.pretrained_context,
)
