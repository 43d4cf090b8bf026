"""A pipeline stage's module, this rank's stages built from the (PEFT-wrapped) model, their schedule.

What is sharded: the decoder layers, by stage (`Layout.layers_of`, as `parallel.pp_split` cuts
them). Stage 0 also holds the embedding, the last stage the final norm, lm_head and the loss.
Every stage recomputes what the family's Model.forward computes once: the mask, position ids
and rotary cos/sin (a non-persistent buffer, so each stage holds a copy). A padded batch carries a 2-D attention mask, a packed one
(docs/packing.md) per-document position ids and no mask; either is a keyword argument of the
step, which torch splits per micro-batch and hands to every stage. From the attention mask come
positions 0..T-1 and the causal + padding mask; from packed position ids, the document block mask
of the `flex` kernel (`distft.model.attention`; transformers' dense block-diagonal mask under
sdpa/eager), one block per document, the fill of the fixed-length row included. Layers keep
their global index (`layers.2.self_attn.q_proj.lora_A`), so checkpoints and the exported adapter
need no renaming. Nothing is sent by this module: torch's `PipelineStage` moves the hidden states
(and their gradients) between stages on different ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from distft.config import Config
from distft.data.pairs import rows_per_item
from distft.errors import ConfigError
from distft.model import summed_loss
from distft.model.lm import run_layers
from distft.model.preference import sequence_logps
from distft.model.router import catching
from distft.parallel.base import Batch
from distft.parallel.pipeline.layout import SCHEDULES, SINGLE_STAGE, Layout

Action = tuple[str, int, int]  # (kind F|B|W, stage, micro-batch)


class StageModule(nn.Module):
    """The part of the model one stage runs, built from the (PEFT-wrapped) model's own modules.

    forward(x, labels, attention_mask | position_ids): x is input_ids (batch, seq) on the first stage and the
    hidden states (batch, seq, hidden) elsewhere; returns the hidden states, or on the last stage
    the summed token loss (shape (1,)), so the loss head is part of the stage's timed forward and
    its parameters (lm_head) belong to the stage for the zero-bubble weight pass. A preference
    objective's head is the `LossLM`'s (`loss_lm`): its pairs' loss from each sequence's
    log-probability and the micro-batch's precomputed reference, or in scoring mode the
    log-probabilities themselves (`PipelineParallel.scores`).
    """

    def __init__(
        self,
        backbone: nn.Module,
        lm_head: nn.Module,
        layer_ids: range,
        first: bool,
        last: bool,
        loss_lm: nn.Module | None = None,
    ):
        super().__init__()
        self._loss_lm = [loss_lm]  # in a list: not registered, its parameters are the stages' own
        self.config = backbone.config
        self.embed_tokens = backbone.embed_tokens if first else None
        # Keyed by the global layer index: names (and the mask type per layer) need no remapping.
        self.layers = nn.ModuleDict({str(i): backbone.layers[i] for i in layer_ids})
        self.rotary_emb = backbone.rotary_emb  # inv_freq is a non-persistent buffer: shared, no state
        self.norm = backbone.norm if last else None
        self.lm_head = lm_head if last else None

    @property
    def loss_lm(self) -> nn.Module | None:
        return self._loss_lm[0]

    def owned(self) -> list[nn.Module]:
        """The modules whose weights this stage trains (the rotary module has none)."""
        return [m for m in (self.embed_tokens, *self.layers.values(), self.norm, self.lm_head) if m]

    def forward(
        self,
        x: torch.Tensor,  # (batch, seq) token ids on the first stage, else (batch, seq, hidden)
        router_sums: torch.Tensor | None = None,  # an MoE's, from the stages before (training)
        *,
        labels: torch.Tensor,  # (batch, seq), pre-shifted, -100 where no loss
        attention_mask: torch.Tensor | None = None,  # (batch, seq), 1 for real tokens (padded)
        position_ids: torch.Tensor | None = None,  # (batch, seq), from 0 at each document (packed)
        **preference: torch.Tensor,  # a preference objective's (`LossLM.forward`), for the last stage
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        # What the family's forward computes once (positions, masks, rotary cos/sin), every stage
        # recomputes (`run_layers`): a decoder layer without them fails.
        layers = ((int(index), layer) for index, layer in self.layers.items())
        router = self.loss_lm.router if self.loss_lm is not None and torch.is_grad_enabled() else None
        with catching(router):
            hidden = run_layers(self, layers, hidden, attention_mask, position_ids)
        if router is not None:  # the routers' auxiliary losses pool every layer: their sums travel on
            mine = router.layer_sums(attention_mask)
            router_sums = mine if router_sums is None else router_sums + mine
        if self.lm_head is None:
            return hidden if router is None else (hidden, router_sums)
        if self.loss_lm is not None and self.loss_lm.preference is not None:
            logps, counts = sequence_logps(self.norm(hidden), self.lm_head, labels, position_ids)
            # The reference is always precomputed here; scoring returns one value per sequence.
            out = self.loss_lm.preference_head(logps, counts, None, preference)
            if self.loss_lm.scoring:
                return out
            units = self.loss_lm.preference.units(counts, preference.get("desirable"))
        else:
            out, units = summed_loss(self.norm(hidden), self.lm_head, labels), labels.ne(-100).sum()
        if router is not None:
            term = router.pooled_term(router_sums, torch.as_tensor(units, device=out.device))
            out = out if term is None else out + term
        # Shape (1,), not a scalar: torch's eval() concatenates the last stage's outputs.
        # A fresh tensor, not a view of the scalar: FSDP (fsdp+pp) warns that its backward hook on a
        # view would be lost to an in-place op.
        return out.reshape(1).clone()


class PipelineModel(nn.Module):
    """This rank's stages, seen under the single model's parameter names.

    Its registered modules mirror the paths of `LossLM` (`lm.base_model.model.model.layers.2`,
    ...) but hold only this rank's embedding, layers, norm and lm_head, so `parameters()` is what
    this rank trains (the optimizer's view) and every name is global: DCP checkpoints of different
    ranks never collide and the export needs no renaming. `module` (not registered) is the whole
    `LossLM`, whose structure the PEFT export walks; only this rank's parts of it are trained.
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


def single_model_state(state: dict, view: PipelineModel, single: bool = True) -> dict:
    """A checkpoint's state (`Strategy.checkpoint_state`: model and flattened optimizer state) under
    the single model's names, or back from them (`single` False). Only one name differs: a tied
    lm_head on a rank without the embedding, which one process lists as the embedding."""
    names = {id(p): name for name, p in view.module.named_parameters()}
    renamed = {name: names[id(p)] for name, p in view.named_parameters() if names[id(p)] != name}
    if not single:
        renamed = {to: name for name, to in renamed.items()}

    def rename(key: str) -> str:
        for part in ("state.", "param_groups."):  # `state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`
            if key.startswith(part):
                fqn, _, leaf = key.removeprefix(part).rpartition(".")
                return f"{part}{renamed.get(fqn, fqn)}.{leaf}"
        return renamed.get(key, key)

    return {part: {rename(key): value for key, value in items.items()} for part, items in state.items()}


def build_stages(
    model: nn.Module,
    lay: Layout,
    rank: int,
    device: torch.device,
    group: dist.ProcessGroup | None,
    wrap: Callable[[StageModule, int], None],
) -> tuple[list[PipelineStage], PipelineModel]:
    """Pipeline rank `rank`'s stages (torch's `PipelineStage`s, which send and receive over `group`)
    and the view of the `LossLM` that holds only their modules.

    `wrap(module, stage)` shards a stage's module in place before its `PipelineStage` is built
    (fsdp+pp: FSDP2 on each layer and the stage; 3D: tensor parallelism first), as torchtitan
    does: torch's stage then sees an FSDP module and defers its gradient reduction to the step's end.
    """
    backbone, lm_head = model.backbone, model.lm_head
    last = lay.num_stages - 1
    stages, owned = [], []
    for s in lay.stages_of(rank):
        layers = lay.layers_of(s)
        module = StageModule(backbone, lm_head, layers, s == 0, s == last, model).to(device)
        owned += module.owned()
        wrap(module, s)
        stages.append(PipelineStage(module, s, lay.num_stages, device, group=group))
    return stages, PipelineModel(model, owned)


def build_schedule(lay: Layout, stages: list[PipelineStage], loss_fn: Callable) -> object:
    """torch's schedule over this rank's stages; gradients are not divided by m (`scale_grads=False`)."""
    cls, _, _ = SCHEDULES[lay.schedule]
    args = {"n_microbatches": lay.microbatches, "loss_fn": loss_fn, "scale_grads": False}
    return cls(stages[0], **args) if lay.schedule in SINGLE_STAGE else cls(stages, **args)


def schedule_actions(lay: Layout, schedule: object) -> list[list[Action]]:
    """Each pipeline rank's F/B/W passes in the order `schedule` runs them (gpipe and 1f1b keep no
    action list in torch: their order is written out; the others read `pipeline_order`)."""
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
            for a in schedule.pipeline_order[r]
            if a is not None and a.computation_type.name in kinds
        ]
        for r in range(p)
    ]


def full_batch(micro_batches: list[Batch], cfg: Config, lay: Layout) -> Batch:
    """One (global_batch, seq) batch of the step's micro-batches; a short one (the last validation
    batch) is filled with rows that carry no loss, since the stage shapes are fixed."""
    batch = {k: torch.cat([b[k] for b in micro_batches]) for k in micro_batches[0]}
    per_item = rows_per_item(cfg.train.objective)  # a preference pair: two rows
    rows = 1 if cfg.data.packing else lay.micro_batch_size * per_item  # per micro-batch
    missing = lay.microbatches * rows - batch["input_ids"].shape[0]
    if missing > 0 and set(batch) - {"input_ids", "attention_mask", "position_ids", "labels"}:
        raise ConfigError(
            f"train.objective={cfg.train.objective} runs through a pipeline on whole global "
            f"batches, and this one holds {len(micro_batches)} micro-batches of {lay.microbatches}: "
            "give the validation split at least train.global_batch_size rows."
        )
    if missing > 0:  # packed fill rows: position 0 everywhere, each token a document of its own
        fill = {"input_ids": 0, "attention_mask": 1, "position_ids": 0, "labels": -100}
        batch = {
            k: torch.cat([v, torch.full((missing, v.shape[1]), fill[k], dtype=v.dtype, device=v.device)])
            for k, v in batch.items()
        }
    return batch
