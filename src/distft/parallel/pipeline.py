"""Pipeline parallelism (`pp`): the layer stack cut into stages, micro-batches flowing through them.

What each rank holds. The model is cut into S = p x V stages of contiguous decoder layers, balanced
by layer count (the first L mod S stages take one more). Stage 0 also holds the embedding; stage
S-1 the final norm, lm_head and the loss. Every stage recomputes what Qwen3Model.forward computes
once: position ids 0..T-1, the causal + padding mask from the 2-D attention mask (a keyword
argument of the step, which torch splits per micro-batch and hands to every stage), and rotary
cos/sin (a non-persistent buffer, so each stage holds a copy). LoRA adapters live on every layer
and stay under their global layer index (`layers.2.self_attn.q_proj.lora_A`), so checkpoints and
the exported adapter need no renaming. Placement of stages on ranks:
- looped (gpipe, 1f1b, interleaved-1f1b, zero-bubble): stage s on rank s mod p; rank r holds
  [r, r+p, ...], the last stage (and the loss) sits on rank p-1;
- V-shaped (zbv, V = 2): down the ranks and back, rank r holds [r, 2p-1-r]: rank 0 holds the
  first and the last stage, so the embedding, the loss and a tied lm_head share one rank.

What runs when. Only stage 0's rank reads input_ids and only the last stage's rank the labels.
Per micro-batch and per stage boundary that crosses ranks: forward, one send/recv of the hidden
states (mb, T, hidden); backward, one send/recv of their gradient, same shape. Nothing else moves
during the step. After it: an all-reduce of the loss sum (only the last stage has it), one of the
squared gradient norm (float64, every stage's share, so the logged norm equals one process's),
and in full finetuning of a tied embedding split over two ranks, an all-reduce of its gradient
between those two (each copy saw half of the uses).

The loss. The last stage returns the summed token loss of its micro-batch; the schedule's loss
function divides it by the global number of label tokens and gradients are *not* divided by m
(`scale_grads=False`): torch's default divides by the micro-batch count, which with padding
weighs micro-batches by count instead of by tokens (7e-3 off). Labels come pre-shifted.

Schedules (p = 4 ranks, m = 4 micro-batches, forward 1 unit, full backward 2; F3 = forward of
micro-batch 3, lower case = a rank's second stage; drawn from torch's own action lists):

    GPipe: all forwards, then all backwards; m micro-batches of activations alive at once.
    rank 0 |F0F1F2F3                  B0B0B1B1B2B2B3B3|
    rank 1 |  F0F1F2F3            B0B0B1B1B2B2B3B3    |
    rank 2 |    F0F1F2F3      B0B0B1B1B2B2B3B3        |
    rank 3 |      F0F1F2F3B0B0B1B1B2B2B3B3            |   idle 9 of 21 units on every rank

    1F1B: after a warm-up of forwards, one forward, one backward: the same bubble, but at most
    p micro-batches alive instead of m.
    rank 0 |F0F1F2F3            B0B0  B1B1  B2B2  B3B3|
    rank 1 |  F0F1F2        B0B0F3B1B1  B2B2  B3B3    |
    rank 2 |    F0F1    B0B0F2B1B1F3B2B2  B3B3        |
    rank 3 |      F0B0B0F1B1B1F2B2B2F3B3B3            |   idle 9 of 21

    Interleaved 1F1B, V = 2: each rank holds two thinner stages (r and r+p); the ramp is paid
    in stage-sized steps, 1/V of a rank's work, at the price of V times more messages.
    rank 0 |F0F1F2F3f0f1f2f3            b0b0  b1b1  b2b2  b3b3B0B0B1B1B2B2B3B3|
    rank 1 |  F0F1F2F3f0f1f2f3      b0b0  b1b1  b2b2  b3b3B0B0B1B1B2B2B3B3    |
    rank 2 |    F0F1F2F3f0f1f2  b0b0f3b1b1  b2b2  b3b3B0B0B1B1B2B2B3B3        |
    rank 3 |      F0F1F2F3f0b0b0f1b1b1f2b2b2f3b3b3B0B0B1B1B2B2B3B3            |   idle 9 of 33

    Zero bubble (ZB-H1): backward split into B (input gradient, what the previous stage waits
    for) and W (weight gradient, needed only by the optimizer), W moved into the bubbles.
    rank 0 |F0F1F2F3      B0W0B1W1B2W2B3W3|
    rank 1 |  F0F1F2    B0F3B1W0B2W1B3W2W3|
    rank 2 |    F0F1  B0F2B1F3B2W0B3W1W2W3|
    rank 3 |      F0B0F1B1F2B2F3B3W0W1W2W3|   idle 3 of 15

    ZB-V (p = 2, m = 4): two stages per rank in a V, so the turn at the bottom needs no message.
    rank 0 |F0F1F2f0b0w0f1b1w1F3B0W0f2b2w2B1W1f3b3w3B2W2B3W3  |
    rank 1 |  F0f0F1f1b0w0F2B0W0f2b1w1F3B1W1f3b2w2B2b3B3W2w3W3|   idle 1 of 25

The bubble: with equal stage times each rank idles p-1 slots of (forward + backward) while the
pipeline fills and drains, out of m busy ones: idle fraction (p-1)/(m+p-1), GPipe and 1F1B alike
(the schedules differ in memory, not in bubble). Interleaving makes a slot V times shorter:
(p-1)/(V m+p-1). Zero bubble, with F = B = W per stage, leaves p-1 single-unit slots of 3 V m:
(p-1)/(3 V m+p-1), for zero-bubble and zbv alike (that is what torch's action lists give under
equal times; the paper's ZB-V figure is ~0 for whole-model units). The split pays off only when
W is worth moving: under LoRA the weight gradients are the adapters', small, so W is cheap and
there is little to fill the bubble with. `theoretical_idle_fraction` returns these.

Measuring it. Every F, B and W a stage computes is timed (its `forward_one_chunk`,
`backward_one_chunk`, `backward_weight_one_chunk`); time between them is waiting (recv, the
schedule's own bookkeeping). Per rank: idle fraction = 1 - busy / step time, the step being the
schedule's `step()` on that rank. `metrics.jsonl` gets `idle_fraction` (mean over ranks) and
`idle_fraction_theory`; `DIR/pipeline_timeline.json` holds the last step:

    {"schedule": "1f1b", "p": 2, "m": 4, "V": 1, "step": 10, "step_time_s": 0.41,
     "idle_fraction": 0.32, "idle_fraction_theory": 0.2, "idle_fraction_imbalance_floor": 0.3,
     "idle_fraction_replayed": 0.33,
     "ranks": [{"rank": 0, "stages": [0], "step_time_s": 0.40, "busy_s": 0.27,
                "idle_fraction": 0.33,
                "events": [{"stage": 0, "microbatch": 0, "kind": "F", "start": 0.001,
                            "end": 0.012}, ...]}, ...]}

`idle_fraction_imbalance_floor` = 1 - mean(busy) / max(busy): no schedule makes a step shorter
than its busiest rank, so with unequal stages the others idle at least that much (on the CPU
presets the last stage, with lm_head over 151,936 tokens, outweighs all decoder layers).
`idle_fraction_replayed`: the schedule's own action order replayed with each pass taking its
measured mean time and messages free (`replay`); measured minus replayed is what the stage times
do not explain (waiting on messages, overhead), replayed minus theory what unequal stages cost.
Times are seconds from that rank's step start. kind: F forward (on the last stage it includes
lm_head and the loss), B backward (input and weight gradients; input only under zero-bubble and
zbv, whose first stage does all its work in W, having no input gradient to send), W weight
gradients.

Papers: Huang et al., "GPipe" (1811.06965); Narayanan et al., "PipeDream" (1F1B, 1806.03377);
Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (interleaved 1F1B, 2104.04473); Qi et al., "Zero Bubble Pipeline Parallelism"
(2401.10241).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from transformers import PretrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from distft.config import Config
from distft.errors import ConfigError
from distft.io.files import atomic_write_text
from distft.model import summed_loss
from distft.parallel.base import Batch, Strategy

# schedule name -> (torch class, stages per rank when parallel.stages_per_rank is 0, V-shaped placement)
SCHEDULES: dict[str, tuple[type, int, bool]] = {
    "gpipe": (ScheduleGPipe, 1, False),  # all forwards, then all backwards (fill, drain)
    "1f1b": (Schedule1F1B, 1, False),  # one forward, one backward in the steady state
    "interleaved-1f1b": (ScheduleInterleaved1F1B, 2, False),  # 1F1B over V looped stages per rank
    "zero-bubble": (ScheduleInterleavedZeroBubble, 1, False),  # B split into input (B) and weight (W)
    "zbv": (ScheduleZBVZeroBubble, 2, True),  # zero bubble, 2 stages per rank placed in a V
}
SINGLE_STAGE = ("gpipe", "1f1b")  # torch's PipelineScheduleSingle: exactly one stage per rank


# ---------------------------------------------------------------------------------------------
# Layout: which rank holds which stage and which layers (a pure function of the config)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    schedule: str
    ranks: int  # p: pipeline ranks (the whole world under pp; parallel.pp under ddp+pp)
    stages_per_rank: int  # V
    microbatches: int  # m
    micro_batch_size: int  # sequences per micro-batch

    @property
    def num_stages(self) -> int:
        return self.ranks * self.stages_per_rank

    @property
    def v_shaped(self) -> bool:
        return SCHEDULES[self.schedule][2]

    def rank_of(self, stage: int) -> int:
        """Looped: stage s on rank s mod p. V-shaped: down the ranks, then back up (0,1,..,p-1,p-1,..,0)."""
        p = self.ranks
        if self.v_shaped:
            return stage if stage < p else 2 * p - 1 - stage
        return stage % p

    def stages_of(self, rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.rank_of(s) == rank]

    def layers_of(self, stage: int, num_layers: int) -> range:
        """Contiguous layers, balanced by count; the first L mod S stages take one more."""
        base, extra = divmod(num_layers, self.num_stages)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (stage < extra))

    def theoretical_idle_fraction(self) -> float:
        """Idle share of each rank's step time with equal stage times (see the module docstring)."""
        p, m, v = self.ranks, self.microbatches, self.stages_per_rank
        if self.schedule in ("zero-bubble", "zbv"):  # F = B(input) = W: 3 V m busy units per rank
            return (p - 1) / (3 * v * m + p - 1)
        return (p - 1) / (v * m + p - 1)  # V = 1 for gpipe and 1f1b


def layout(cfg: Config, ranks: int | None = None, replicas: int = 1) -> Layout:
    """The pipeline described by `cfg`, checked; raises ConfigError for one that cannot run.

    `ranks`: pipeline ranks (default: the world size); `replicas`: data-parallel copies of the
    pipeline (ddp+pp), each running its share of the global batch through its own schedule.
    """
    par, train = cfg.parallel, cfg.train
    if par.schedule not in SCHEDULES:
        choices = ", ".join(SCHEDULES)
        raise ConfigError(f"`parallel.schedule` is {par.schedule!r}; choose one of {choices}.")
    p = ranks or cfg.world_size
    if p < 2:
        raise ConfigError("--strategy pp splits the model across processes: use --nproc 2 or more.")
    if par.stages_per_rank < 0 or par.microbatches < 0:
        raise ConfigError("`parallel.stages_per_rank` and `parallel.microbatches` cannot be negative.")
    if train.global_batch_size % replicas:
        raise ConfigError(
            f"train.global_batch_size ({train.global_batch_size}) must be a multiple of parallel.dp ({replicas}): "
            "each data-parallel pipeline replica runs an equal share."
        )
    batch = train.global_batch_size // replicas  # sequences through one pipeline per step
    what = (
        f"train.global_batch_size ({batch})"
        if replicas == 1
        else f"each replica's share of train.global_batch_size ({train.global_batch_size} / {replicas} = {batch})"
    )
    if not par.microbatches and batch % train.micro_batch_size:
        raise ConfigError(
            f"{what} must be a multiple of train.micro_batch_size "
            f"({train.micro_batch_size}), or set the number of micro-batches with parallel.microbatches."
        )
    v = par.stages_per_rank or SCHEDULES[par.schedule][1]
    if par.schedule in SINGLE_STAGE and v != 1:
        raise ConfigError(
            f"parallel.schedule={par.schedule} runs one stage per rank, but parallel.stages_per_rank={v}. "
            "Use parallel.schedule=interleaved-1f1b (or zero-bubble) for several stages per rank."
        )
    if par.schedule == "zbv" and v != 2:
        raise ConfigError(f"parallel.schedule=zbv places exactly 2 stages per rank (a V); got {v}.")
    m = par.microbatches or batch // train.micro_batch_size
    if batch % m:
        raise ConfigError(
            f"{what} cannot be cut into {m} equal micro-batches: parallel.microbatches must divide it."
        )
    if par.schedule == "1f1b" and m < p:
        raise ConfigError(
            f"parallel.schedule=1f1b needs at least as many micro-batches as pipeline ranks ({p}), got {m}: "
            f"raise parallel.microbatches (or train.global_batch_size), e.g. parallel.microbatches={2 * p}."
        )
    if par.schedule in ("interleaved-1f1b", "zero-bubble"):
        rounds = max(1, m // p)  # torch runs these in rounds of equal size
        if m % rounds:
            raise ConfigError(
                f"parallel.schedule={par.schedule} runs the micro-batches in max(1, m // p) = {rounds} rounds of "
                f"equal size, which m = {m} over p = {p} ranks does not allow. Use a multiple of {p}, "
                f"e.g. parallel.microbatches={p * rounds}."
            )
    return Layout(par.schedule, p, v, m, batch // m)


Action = tuple[str, int, int]  # (kind F|B|W, stage, micro-batch)


def replay(actions: list[list[Action]], durations: dict[tuple[int, str], float]) -> float | None:
    """Idle fraction of `actions` (each rank's compute, in order) if every pass took its measured
    mean duration and messages were instant; None if the actions do not all complete.

    Dependencies: F(s, i) after F(s-1, i); B(s, i) after F(s, i) and B(s+1, i); W(s, i) after
    B(s, i). Against the measured idle fraction it separates what the stage times explain (the
    schedule's bubble plus unequal stages) from what they do not (waiting on messages, overhead).
    """
    last = max(s for row in actions for _, s, _ in row)
    done: dict[Action, float] = {}
    free, busy, nxt = [0.0] * len(actions), [0.0] * len(actions), [0] * len(actions)
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(actions):
            while nxt[r] < len(row):
                kind, s, i = row[nxt[r]]
                deps = {"F": [("F", s - 1, i)] if s else [], "W": [("B", s, i)]}.get(
                    kind, [("F", s, i)] + ([("B", s + 1, i)] if s < last else [])
                )
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                free[r] = done[(kind, s, i)] = start + durations[(s, kind)]
                busy[r] += durations[(s, kind)]
                nxt[r] += 1
                progress = True
    if any(n < len(row) for n, row in zip(nxt, actions, strict=True)):
        return None
    return statistics.mean(1 - b / max(free) for b in busy)


def mean_durations(ranks: list[dict]) -> dict[tuple[int, str], float]:
    """Mean duration of each (stage, kind) pass over a timeline's events."""
    spans: dict[tuple[int, str], list[float]] = {}
    for r in ranks:
        for e in r["events"]:
            spans.setdefault((e["stage"], e["kind"]), []).append(e["end"] - e["start"])
    return {key: statistics.mean(v) for key, v in spans.items()}


# ---------------------------------------------------------------------------------------------
# A stage: embedding (first), a run of decoder layers, final norm + lm_head + loss (last)
# ---------------------------------------------------------------------------------------------


class StageModule(nn.Module):
    """The part of Qwen3 one stage runs, built from the (PEFT-wrapped) model's own modules.

    forward(x, attention_mask, labels): x is input_ids (batch, seq) on the first stage and the
    hidden states (batch, seq, hidden) elsewhere; returns the hidden states, or on the last stage
    the summed token loss (shape (1,)), so the loss head is part of the stage's timed forward and
    its parameters (lm_head) belong to the stage for the zero-bubble weight pass.
    """

    def __init__(self, backbone: nn.Module, lm_head: nn.Module, layer_ids: range, first: bool, last: bool):
        super().__init__()
        self.config = backbone.config
        self.embed_tokens = backbone.embed_tokens if first else None
        # Keyed by the global layer index: names (and the mask type per layer) need no remapping.
        self.layers = nn.ModuleDict({str(i): backbone.layers[i] for i in layer_ids})
        self.rotary_emb = backbone.rotary_emb  # inv_freq is a non-persistent buffer: shared, no state
        self.norm = backbone.norm if last else None
        self.lm_head = lm_head if last else None

    def forward(
        self,
        x: torch.Tensor,  # (batch, seq) token ids on the first stage, else (batch, seq, hidden)
        attention_mask: torch.Tensor,  # (batch, seq), 1 for real tokens; reaches every stage as a kwarg
        labels: torch.Tensor,  # (batch, seq), pre-shifted, -100 where no loss
    ) -> torch.Tensor:
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        # What Qwen3Model.forward computes once, every stage recomputes: positions 0..S-1 (right
        # padding), the causal + padding mask, and rotary cos/sin (a decoder layer without them fails).
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask_args = {
            "config": self.config,
            "inputs_embeds": hidden,
            "attention_mask": attention_mask,
            "past_key_values": None,
            "position_ids": position_ids,
        }
        masks = {"full_attention": create_causal_mask(**mask_args)}
        if "sliding_attention" in self.config.layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_args)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for index, layer in self.layers.items():
            hidden = layer(
                hidden,
                attention_mask=masks[self.config.layer_types[int(index)]],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
            )
        if self.lm_head is None:
            return hidden
        # Shape (1,), not a scalar: torch's eval() concatenates the last stage's outputs.
        return summed_loss(self.norm(hidden), self.lm_head, labels).reshape(1)


class PipelineModel(nn.Module):
    """This rank's stages, seen under the single model's parameter names.

    Its registered modules mirror the paths of `SummaryLM` (`lm.base_model.model.model.layers.2`,
    ...) but hold only this rank's embedding, layers, norm and lm_head, so `parameters()` is what
    this rank trains (the optimizer's view) and every name is global: DCP checkpoints of different
    ranks never collide and the export needs no renaming. `module` (not registered) is the whole
    `SummaryLM`, whose structure the PEFT export walks; only this rank's parts of it are trained.
    """

    def __init__(self, full: nn.Module, owned: list[nn.Module]):
        super().__init__()
        object.__setattr__(self, "module", full)  # unregistered: not in parameters() or state_dict()
        paths = {id(m): name for name, m in full.named_modules()}
        for module in owned:
            *parents, leaf = paths[id(module)].split(".")
            node: nn.Module = self
            for name in parents:
                if name not in node._modules:
                    node.add_module(name, nn.Module())
                node = node._modules[name]
            node.add_module(leaf, module)

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipelined model runs through its schedule (PipelineParallel.forward_backward)")


# ---------------------------------------------------------------------------------------------
# The strategy
# ---------------------------------------------------------------------------------------------


class PipelineParallel(Strategy):
    name = "pp"
    fixed_sequence_length: ClassVar[bool] = True  # stage shapes are inferred once, then frozen

    @classmethod
    def pipeline_layout(cls, cfg: Config) -> Layout:
        """This strategy's pipeline: every rank is a pipeline rank (ddp+pp: parallel.pp of them)."""
        return layout(cfg)

    @classmethod
    def validate_config(cls, cfg: Config) -> None:
        cls.pipeline_layout(cfg)  # raises ConfigError for a pipeline that cannot run

    @classmethod
    def micro_batch_size(cls, cfg: Config) -> int:
        return cls.pipeline_layout(cfg).micro_batch_size  # the global batch is cut into m of these

    @classmethod
    def validate_model(cls, cfg: Config, model_config: PretrainedConfig) -> None:
        lay = cls.pipeline_layout(cfg)
        layers = model_config.num_hidden_layers
        if lay.num_stages > layers:
            raise ConfigError(
                f"--strategy {cls.name} with {lay.ranks} pipeline ranks x {lay.stages_per_rank} stages per rank needs "
                f"{lay.num_stages} stages of at least one decoder layer, but {cfg.model.name} has {layers}. "
                "Use fewer processes or parallel.stages_per_rank."
            )

    @classmethod
    def data_parallel_size(cls, cfg: Config) -> int:
        return 1  # every rank sees the whole batch; stage 0 reads the ids, the last stage the labels

    # -- set-up --------------------------------------------------------------------------------
    def pipelines(self) -> list[list[int]]:
        """Global ranks of every pipeline, each indexed by pipeline rank (pp: one, the world)."""
        return [list(range(self.env.world_size))]

    def pipeline_group(self) -> dist.ProcessGroup | None:
        """The process group of this rank's pipeline (None: the default group)."""
        return None

    def parallelize(self, model: nn.Module) -> nn.Module:
        self.layout = lay = self.pipeline_layout(self.cfg)
        pipelines = self.pipelines()
        # This rank's pipeline (global ranks by pipeline rank) and its place in it. Layout methods
        # speak pipeline ranks; p2p outside the schedule (evaluation) maps them through pp_ranks.
        self.pp_ranks = next(ranks for ranks in pipelines if self.env.rank in ranks)
        self.pp_rank = rank = self.pp_ranks.index(self.env.rank)
        self.pp_group = self.pipeline_group()
        device = self.env.device
        backbone, lm_head = model.backbone, model.lm_head
        num_layers = len(backbone.layers)
        self.stage_ids = lay.stages_of(rank)
        last = lay.num_stages - 1
        self.stages: list[PipelineStage] = []
        self.events: list[dict] = []  # this step's F/B/W intervals (perf_counter seconds)
        self._recording = False  # only training steps are timed (not the warm-up, not evaluation)
        owned: list[nn.Module] = []
        for s in self.stage_ids:
            module = StageModule(backbone, lm_head, lay.layers_of(s, num_layers), s == 0, s == last).to(
                device
            )
            owned += [
                m for m in (module.embed_tokens, *module.layers.values(), module.norm, module.lm_head) if m
            ]
            stage = PipelineStage(module, s, lay.num_stages, device, group=self.pp_group)
            self._instrument(stage)
            self.stages.append(stage)
        self.holds_first, self.holds_last = 0 in self.stage_ids, last in self.stage_ids
        cls, _, _ = SCHEDULES[lay.schedule]
        args = {"n_microbatches": lay.microbatches, "loss_fn": self._loss, "scale_grads": False}
        self.schedule = (
            cls(self.stages[0], **args) if lay.schedule in SINGLE_STAGE else cls(self.stages, **args)
        )
        view = PipelineModel(model, owned)

        # Tied embedding / lm_head on two ranks (full finetuning): each copy gets its stage's part of
        # the gradient; the two are summed so both copies take the same step and stay equal.
        first_rank, last_rank = lay.rank_of(0), lay.rank_of(last)
        tied = backbone.embed_tokens.weight is lm_head.weight
        self.tied_weight: nn.Parameter | None = None
        self.tie_group = None
        if tied and lm_head.weight.requires_grad and first_rank != last_rank:
            for ranks in pipelines:  # one pair per pipeline; every rank takes part in creating each
                group = dist.new_group([ranks[first_rank], ranks[last_rank]])
                if self.env.rank in ranks:
                    self.tie_group = group
            if rank in (first_rank, last_rank):
                self.tied_weight = lm_head.weight
        self.counts_tied_in_norm = rank != last_rank or first_rank == last_rank

        self._warm_up()
        return view

    def _warm_up(self) -> None:
        """One step on an all-padding batch: it builds the stage shapes and the p2p channels.

        torch's stages infer their input/output shapes on the first step, sending metadata between
        ranks; doing it here keeps that traffic out of the first counted step. No label carries loss,
        so every gradient is exactly zero; they are dropped, and the RNG is restored.
        """
        lay, length = self.layout, self.cfg.data.max_length
        shape = (lay.micro_batch_size, length)
        batch = {
            "input_ids": torch.zeros(shape, dtype=torch.long),
            "attention_mask": torch.ones(shape, dtype=torch.long),
            "labels": torch.full(shape, -100, dtype=torch.long),
        }
        batches = [{k: v.to(self.env.device) for k, v in batch.items()} for _ in range(lay.microbatches)]
        with torch.random.fork_rng(devices=[]):
            self._run(batches, num_label_tokens=1)
        for stage in self.stages:
            stage.submod.zero_grad(set_to_none=True)

    # -- timing --------------------------------------------------------------------------------
    def _instrument(self, stage: PipelineStage) -> None:
        """Record start and end of every F, B and W this stage computes (the waits lie between).

        The first micro-batch's forward also runs under the loop's activation probe, if any.
        """
        for method, kind in (
            ("forward_one_chunk", "F"),
            ("backward_one_chunk", "B"),
            ("backward_weight_one_chunk", "W"),
        ):
            original = getattr(stage, method)

            def timed(chunk: int, *args, _original=original, _kind=kind, _stage=stage.stage_index, **kwargs):
                if not self._recording:
                    return _original(chunk, *args, **kwargs)
                probe = self.activation_probe if _kind == "F" and chunk == 0 else None
                start = time.perf_counter()
                if probe is not None:
                    with probe:
                        out = _original(chunk, *args, **kwargs)
                else:
                    out = _original(chunk, *args, **kwargs)
                end = time.perf_counter()
                self.events.append(
                    {"stage": _stage, "microbatch": chunk, "kind": _kind, "start": start, "end": end}
                )
                return out

            setattr(stage, method, timed)

    # -- one step ------------------------------------------------------------------------------
    def _loss(self, loss_sum: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Last stage, per micro-batch: the stage already summed the token losses; scale to the global mean."""
        self._loss_sums.append(loss_sum.detach())
        return loss_sum.sum() / self._num_label_tokens

    def _run(self, micro_batches: list[Batch], num_label_tokens: int) -> torch.Tensor:
        batch = self._full_batch(micro_batches)
        self._num_label_tokens = num_label_tokens
        self._loss_sums: list[torch.Tensor] = []
        args = (batch["input_ids"],) if self.holds_first else ()
        target = batch["labels"] if self.holds_last else None
        self.schedule.step(
            *args,
            attention_mask=batch["attention_mask"],
            labels=batch["labels"],
            target=target,
            return_outputs=False,
        )
        total = torch.zeros((), device=self.env.device)
        for loss_sum in self._loss_sums:
            total += loss_sum.float().sum()
        return total

    def forward_backward(
        self, model: nn.Module, micro_batches: list[Batch], num_label_tokens: int
    ) -> torch.Tensor:
        self.events = []
        self._recording = True
        start = time.perf_counter()
        try:
            total = self._run(micro_batches, num_label_tokens)
        finally:
            self._recording = False
        self.step_start, self.step_time = start, time.perf_counter() - start
        self.after_backward(model)
        return total

    def after_backward(self, model: nn.Module) -> None:
        if self.tied_weight is not None and self.tied_weight.grad is not None:
            dist.all_reduce(self.tied_weight.grad, group=self.tie_group)

    @torch.no_grad()
    def forward_only(self, model: nn.Module, micro_batches: list[Batch]) -> torch.Tensor:
        """Evaluation: each micro-batch passes the stages in order, with blocking sends between ranks.

        Not torch's `schedule.eval()`: that fails for V-shaped placements and re-initialises the
        stages (a metadata exchange) on every switch between training and evaluation. Speed does
        not matter here; this path is sequential, plain and the same for every schedule.
        """
        lay, me, ranks = self.layout, self.pp_rank, self.pp_ranks
        batch = self._full_batch(micro_batches)
        chunks = {k: v.split(lay.micro_batch_size) for k, v in batch.items()}
        hidden_size = model.module.backbone.config.hidden_size
        dtype = next(self.stages[0].submod.parameters()).dtype
        modules = {stage.stage_index: stage.submod for stage in self.stages}
        total = torch.zeros((), device=self.env.device)
        for i in range(lay.microbatches):
            ids, mask, labels = chunks["input_ids"][i], chunks["attention_mask"][i], chunks["labels"][i]
            x = ids
            for s in self.stage_ids:
                if s > 0 and lay.rank_of(s - 1) != me:
                    x = torch.empty((*ids.shape, hidden_size), dtype=dtype, device=self.env.device)
                    dist.recv(x, src=ranks[lay.rank_of(s - 1)])
                x = modules[s](x, attention_mask=mask, labels=labels)
                if s == lay.num_stages - 1:
                    total += x.float().sum()
                elif lay.rank_of(s + 1) != me:
                    dist.send(x.to(dtype).contiguous(), dst=ranks[lay.rank_of(s + 1)])
        return total

    def _full_batch(self, micro_batches: list[Batch]) -> Batch:
        """One (global_batch, seq) batch; a short one (the last validation batch) is filled with rows
        that carry no loss, since the stage shapes are fixed."""
        batch = {k: torch.cat([b[k] for b in micro_batches]) for k in micro_batches[0]}
        missing = self.layout.microbatches * self.layout.micro_batch_size - batch["input_ids"].shape[0]
        if missing > 0:
            fill = {"input_ids": 0, "attention_mask": 1, "labels": -100}
            batch = {
                k: torch.cat([v, torch.full((missing, v.shape[1]), fill[k], dtype=v.dtype, device=v.device)])
                for k, v in batch.items()
            }
        return batch

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> float:
        """The norm over every stage's gradients (float64 squares, summed over the pipeline's ranks:
        data-parallel replicas hold equal gradients and are not counted twice), then clip."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        square = torch.zeros((), dtype=torch.float64, device=self.env.device)
        for p in model.parameters():
            if p.grad is None or (p is self.tied_weight and not self.counts_tied_in_norm):
                continue  # the tied copy on the last stage's rank is counted on the first's
            square += torch.linalg.vector_norm(p.grad, dtype=torch.float64) ** 2
        dist.all_reduce(square, group=self.pp_group)
        norm = square.sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.to(g.dtype))
        return float(norm)

    def reduce_loss(self, local_sum: torch.Tensor) -> torch.Tensor:
        """Only the last stage's rank has a loss; a sum over ranks gives it to everyone."""
        local_sum = local_sum.clone()
        dist.all_reduce(local_sum)
        return local_sum

    def trainable_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Every rank's trained parameters, gathered on rank 0 under the single model's names."""
        mine = {
            name.removeprefix("lm."): p.detach().cpu().clone()
            for name, p in model.named_parameters()
            if p.requires_grad
        }
        gathered: list[dict | None] | None = [None] * self.env.world_size if self.env.is_main else None
        dist.gather_object(mine, gathered, dst=0)
        if not self.env.is_main:
            return None
        # The single model lists a tied lm_head once, as the embedding: keep its names only.
        names = {n for n, p in model.module.lm.named_parameters() if p.requires_grad}
        state = {}
        for part in gathered:
            state.update({n: t for n, t in part.items() if n in names})
        return state

    # -- figures -------------------------------------------------------------------------------
    def expected_comm_bytes(self, model: nn.Module, batches: list[Batch]) -> dict[str, int]:
        lay, me = self.layout, self.pp_rank
        hidden = model.module.backbone.config.hidden_size
        itemsize = next(model.module.parameters()).element_size()
        seq = batches[0]["input_ids"].shape[1]
        activation = lay.micro_batch_size * seq * hidden * itemsize  # one (mb, seq, hidden) tensor
        send = recv = 0
        for s in range(lay.num_stages - 1):
            src, dst = lay.rank_of(s), lay.rank_of(s + 1)
            if src == dst:
                continue  # V-shaped turn: the next stage is on this rank, no message
            if me == src:  # activations out, their gradients back in
                send += lay.microbatches * activation
                recv += lay.microbatches * activation
            if me == dst:
                recv += lay.microbatches * activation
                send += lay.microbatches * activation
        all_reduce = 4 + 8  # the loss sum (fp32) and the squared gradient norm (float64)
        if self.tied_weight is not None:
            all_reduce += self.tied_weight.numel() * self.tied_weight.element_size()
        out = {"all_reduce": all_reduce}
        if send:
            out["send"], out["recv"] = send, recv
        return out

    def _actions(self) -> list[list[Action]]:
        """Each rank's F/B/W passes in the order this schedule runs them (for `replay`)."""
        lay = self.layout
        p, m = lay.ranks, lay.microbatches
        if lay.schedule == "gpipe":
            return [[("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)] for r in range(p)]
        if lay.schedule == "1f1b":  # torch's order: p-r warm-up forwards, then backward-first pairs
            rows = []
            for r in range(p):
                warm = min(m, p - r)
                row = [("F", r, i) for i in range(warm)]
                for i in range(m - warm):
                    row += [("B", r, i), ("F", r, warm + i)]
                rows.append(row + [("B", r, i) for i in range(m - warm, m)])
            return rows
        kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
        return [
            [
                (kinds[a.computation_type.name], a.stage_index, a.microbatch_index)
                for a in self.schedule.pipeline_order[r]
                if a is not None and a.computation_type.name in kinds
            ]
            for r in range(p)
        ]

    def step_report(self, step: int) -> dict:
        """Gather every rank's timeline; idle fraction measured and theoretical; the file on the last step."""
        busy = sum(e["end"] - e["start"] for e in self.events)
        mine = {
            "rank": self.env.rank,
            "stages": self.stage_ids,
            "step_time_s": self.step_time,
            "busy_s": busy,
            "idle_fraction": 1 - busy / self.step_time,
            "events": [
                {**e, "start": e["start"] - self.step_start, "end": e["end"] - self.step_start}
                for e in self.events
            ],
        }
        ranks: list[dict | None] = [None] * self.env.world_size
        dist.all_gather_object(ranks, mine)
        lay = self.layout
        measured = statistics.mean(r["idle_fraction"] for r in ranks)
        busy_r = [r["busy_s"] for r in ranks]
        theory = lay.theoretical_idle_fraction()
        if self.env.is_main and step == self.cfg.train.max_steps:
            timeline = {
                "schedule": lay.schedule,
                "p": lay.ranks,
                "m": lay.microbatches,
                "V": lay.stages_per_rank,
                "step": step,
                "step_time_s": max(r["step_time_s"] for r in ranks),
                "idle_fraction": measured,
                "idle_fraction_theory": theory,
                # No schedule beats the busiest rank: the others idle at least this much on average.
                "idle_fraction_imbalance_floor": 1 - statistics.mean(busy_r) / max(busy_r),
                "idle_fraction_replayed": replay(self._actions(), mean_durations(ranks)),
                "ranks": ranks,
            }
            atomic_write_text(
                Path(self.cfg.output.dir) / "pipeline_timeline.json", json.dumps(timeline, indent=1)
            )
        return {"idle_fraction": measured, "idle_fraction_theory": theory}
