"""Model FLOPs of a training step, counted from the real model, and MFU against the GPU's peak.

The convention (PaLM, Chowdhery et al. 2204.02311, appendix B; Korthikanti et al. 2205.05198):
only matrix multiplies count, a multiply-add is 2 FLOPs, and backward costs what it computes.

- A weight matrix with N elements costs 2N per token forward. Backward computes the input
  gradient (2N) always, and the weight gradient (2N) only if the weight trains. So a frozen
  weight costs 4N per token and a trainable one 6N: full finetuning is the familiar 6N; LoRA is
  4 N_base + 6 N_adapters (the adapters' two thin matmuls are ordinary trainable weights).
- Attention's two matmuls per layer (Q K^T and attention x V) cost 2 s d_attn each per token
  forward on a sequence of s tokens, d_attn = heads x head_dim; causal masking halves them (token
  t attends to about s/2 keys on average); backward doubles them (no weights: input gradients
  only). Per sequence and layer: 3 x (4 s^2 d_attn) / 2 = 6 s^2 d_attn.
- The LM head runs on the labelled positions only (`distft.model.lm.summed_loss`), so it counts
  per labelled token; the input embedding is a lookup, not a matmul, and counts nothing.

So one step over sequences of s_i tokens with k_i labelled ones costs

    F = sum_i [ s_i (4 N_frozen + 6 N_trainable) + k_i c_head N_head + 6 L d_attn s_i^2 ]

with N_* the decoder layers' Linear weights, N_head = hidden x vocab, c_head = 6 if the head
trains (full finetuning) else 4, and L the layer count. `flops_per_token` = F / sum_i s_i; MFU =
F / step time / (ranks x the GPU's peak dense bf16 FLOP/s), the GPU from `distft.measure.gpus`.
Norms, rotary, softmax and the loss are elementwise, a few percent at most, and not counted.
The pieces are the pipeline's stage cost model's (`distft.parallel.pipeline.cost`: `layers_cost`,
`matmul`), which also splits them into forward, input and weight gradient; here the weights are
counted from the real model (what trains, whatever the method), there from its config (`layer_weights`).
Activation checkpointing runs the layers' forward again in backward (`recompute`): real work, but
not model FLOPs, so MFU leaves it out and a time estimate adds it.

The planner builds the same `ModelFlops` from an architecture (`distft.plan.timing`), so a run
and its plan count one formula. `StepTime` turns a plan's count into seconds: compute at an
assumed MFU, the pipeline's idle share, and the communication no compute hides; a run rescales
its compute to each step's own FLOPs (`for_flops`) to set a predicted time beside the measured one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from distft.data import Example
from distft.data.chat import IGNORE
from distft.measure.gpus import gpu_for_device_name
from distft.model import causal_lm
from distft.parallel.pipeline.cost import PassCost, attention_dim, layers_cost, matmul


@dataclass(frozen=True)
class ModelFlops:
    """The counts the formula above needs, read once from the model before it is parallelized."""

    frozen: int  # weights in the decoder layers' matmuls that do not train (N_frozen)
    trainable: int  # weights in the decoder layers' matmuls that train (N_trainable)
    head: int  # hidden x vocab (N_head)
    head_trains: bool
    layers: int  # L
    attn_dim: int  # heads x head_dim (d_attn)

    @classmethod
    def from_model(cls, model: nn.Module) -> ModelFlops:
        """Counted from `model` (a causal LM, PEFT-wrapped or not; NF4 weights count their shape)."""
        lm = causal_lm(model)
        counts = {True: 0, False: 0}  # requires_grad -> weights
        for name, module in lm.model.layers.named_modules():
            if isinstance(module, nn.Linear) and ".experts" not in f".{name}":
                counts[module.weight.requires_grad] += module.in_features * module.out_features
        # A mixture of experts: a token runs its top-k of the stacked experts (and their adapters,
        # one per expert) and the whole router.
        experts, top_k = getattr(lm.config, "num_experts", 0), getattr(lm.config, "num_experts_per_tok", 0)
        for name, p in lm.model.layers.named_parameters() if experts else ():
            if ".experts." in f".{name}":
                counts[p.requires_grad] += p.numel() // experts * top_k
            elif name.endswith("mlp.gate.weight"):
                counts[p.requires_grad] += p.numel()
        frozen, trainable = counts[False], counts[True]
        # The weight lm_head computes with: peft's wrappers (`distft.model.tokens`) give theirs.
        config, head = lm.config, lm.lm_head.weight  # (vocab, hidden)
        return cls(
            frozen=frozen,
            trainable=trainable,
            head=head.shape[0] * head.shape[1],
            head_trains=head.requires_grad,
            layers=config.num_hidden_layers,
            attn_dim=attention_dim(config),
        )

    def sequence(self, tokens: int, labelled: int) -> int:
        """FLOPs of forward + backward over one sequence of `tokens` tokens, `labelled` of them
        with a loss."""
        return self.layers_flops(tokens) + self.head_flops(labelled)

    def layers_flops(self, tokens: int) -> int:
        """The decoder layers' share of `sequence`: their matmuls and causal attention."""
        return self._layers(tokens).total

    def head_flops(self, labelled: int) -> int:
        """The LM head's share of `sequence`, on the labelled positions only."""
        return matmul(self.head, self.head_trains, labelled).total

    def forward(self, tokens: int, labelled: int) -> int:
        """Forward alone over one sequence, no backward (DPO's reference under the disabled adapters)."""
        return self._layers(tokens).forward + matmul(self.head, self.head_trains, labelled).forward

    def recompute(self, tokens: int) -> int:
        """The layers' forward once more (activation checkpointing)."""
        return self._layers(tokens).forward

    def _layers(self, tokens: int) -> PassCost:
        return layers_cost(self.frozen, self.trainable, self.attn_dim, tokens, self.layers)

    def step(self, examples: list[Example]) -> int:
        """FLOPs of one optimizer step over `examples` (the global batch), every rank together."""
        return sum(self.sequence(len(e.input_ids), sum(t != IGNORE for t in e.labels)) for e in examples)


def peak_flops(device: torch.device) -> tuple[float | None, str]:
    """(peak dense bf16 FLOP/s of one `device`, what it is), or (None, why MFU is not reported)."""
    if device.type != "cuda":
        return None, f"MFU is null on {device.type}: the peak table (distft.measure.gpus) lists GPUs only"
    name = torch.cuda.get_device_name(device)
    gpu = gpu_for_device_name(name)
    if gpu is None or gpu.bf16_tflops is None:
        return None, f"MFU is null: {name} has no peak bf16 figure in distft.measure.gpus"
    return gpu.bf16_tflops * 1e12, f"MFU against {gpu.label}'s {gpu.bf16_tflops:g} TFLOP/s dense bf16 peak"


@dataclass(frozen=True)
class StepTime:
    """The predicted time of one optimizer step, in parts (the planner fills it, `distft.plan.timing`).

    seconds = compute + the pipeline's bubble + blocking + max(0, overlapped - compute): a
    pipeline idles `idle_fraction` of the step (so the bubble is compute x f / (1 - f)),
    collectives on the critical path add their whole time, and those that overlap compute
    show only where they outlast it."""

    compute_s: float  # the busiest rank's FLOPs / (peak x assumed MFU)
    idle_fraction: float = 0.0  # the pipeline's bubble as a share of the step (0 without one)
    blocking_s: float = 0.0  # communication on the critical path (TP's, ZeRO-1's broadcast)
    overlapped_s: float = 0.0  # communication that overlaps compute (DDP's, FSDP's, a pipeline's sends)
    flops: float = 0.0  # model FLOPs of the step it was computed for, every rank together

    @property
    def bubble_s(self) -> float:
        return self.compute_s * self.idle_fraction / (1 - self.idle_fraction)

    @property
    def exposed_comm_s(self) -> float:
        return self.blocking_s + max(0.0, self.overlapped_s - self.compute_s)

    @property
    def seconds(self) -> float:
        return self.compute_s + self.bubble_s + self.exposed_comm_s

    def for_flops(self, flops: float) -> float:
        """The time of a step of `flops` model FLOPs (shorter sequences, fewer labels): compute
        scales with the FLOPs, communication keeps its bytes."""
        if not self.flops:
            return self.seconds
        return replace(self, compute_s=self.compute_s * flops / self.flops).seconds
