"""Pipeline parallelism (`pp`): the layer stack cut into stages, micro-batches flowing through them.

What is sharded: the decoder layers, by stage (`layout.py`), with their gradients and AdamW state;
stage 0 also holds the embedding, the last stage norm, lm_head and the loss. How many layers each
stage holds is `parallel.pp_split`, by default the cut that balances the stages' modelled cost
(`cost.py`), computed in `parallelize` from the architecture, the run's settings and the labelled
positions per row the set-up measured on the training split (`label_tokens`). Only stage 0's rank
reads input_ids and only the last stage's rank the labels.

What is sent when. During the step, per micro-batch and per stage boundary that crosses ranks:
forward, one send/recv of the hidden states (mb, T, hidden); backward, one send/recv of their
gradient, same shape. A mixture of experts sends its routers' sums beside them (2E + 2 floats,
`distft.model.router.RouterLosses.layer_sums`), since its auxiliary losses pool all the layers.
After the step: an all-reduce of the loss sum (only the last stage has it), one of the squared
gradient norm over the pipeline group (float64, every stage's share once), and in full finetuning
of a tied embedding split over two ranks, an all-reduce of its gradient between those two (each
copy saw half of the uses). Checkpoints name a tied lm_head as one process does, after the
embedding (`stages.single_model_state`).

The loss. The last stage returns the summed token loss of its micro-batch; the schedule's loss
function divides it by the global number of label tokens and gradients are *not* divided by m
(`scale_grads=False`): torch's default weighs micro-batches by count instead of by tokens.

Schedule diagrams, the bubble and how the timeline is measured (`distft.measure.pipeline`):
docs/pp.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig

from distft.config import Config
from distft.data import Example, micro_batch
from distft.data.pairs import blank_preference, rows_per_item
from distft.errors import ConfigError
from distft.layout.rules import stage_split
from distft.model.preference import labelled_sequences
from distft.parallel.base import Batch, Strategy, summed
from distft.parallel.pipeline.cost import CostModel
from distft.parallel.pipeline.layout import Layout, layout
from distft.parallel.pipeline.stages import (
    Action,
    build_schedule,
    build_stages,
    full_batch,
    schedule_actions,
    single_model_state,
)
from distft.tensors import local


class PipelineParallel(Strategy):
    name = "pp"
    # What the loss is multiplied by before backward: FSDP's reduce-scatter averages over its dp
    # ranks where the pipeline wants the sum (fsdp+pp sets dp; ddp+pp sums itself).
    loss_scale: int = 1

    @classmethod
    def pipeline_layout(cls, cfg: Config) -> Layout:
        """This strategy's pipeline: every rank is a pipeline rank (on a mesh: parallel.pp of them)."""
        return layout(cfg)

    @classmethod
    def cut_layout(
        cls, cfg: Config, model_config: PretrainedConfig, label_tokens: float | None = None
    ) -> tuple[Layout, CostModel]:
        """This strategy's pipeline with its layers cut (parallel.pp_split), and the cost model the
        cut was made by: the run's method and rows, `label_tokens` labelled positions per row
        (None, before the data is read: `cost.DEFAULT_LABEL_TOKENS`)."""
        costs = CostModel.for_run(cfg, model_config, label_tokens)
        return cls.pipeline_layout(cfg).cut(costs, cfg.parallel.pp_split, cfg.model.name), costs

    @classmethod
    def validate_config(cls, cfg: Config) -> None:
        cls.pipeline_layout(cfg)  # raises ConfigError for a pipeline that cannot run

    @classmethod
    def micro_batch_size(cls, cfg: Config) -> int:
        return cls.pipeline_layout(cfg).micro_batch_size  # the global batch is cut into m of these

    @classmethod
    def validate_model(cls, cfg: Config, model_config: PretrainedConfig) -> None:
        lay = cls.pipeline_layout(cfg)
        if why := stage_split(lay.num_stages, model_config.num_hidden_layers):
            raise ConfigError(
                f"--strategy {cls.name} with {lay.ranks} pipeline ranks x {lay.stages_per_rank} stages per rank needs "
                f"{why}, but {cfg.model.name} has {model_config.num_hidden_layers}. Use fewer processes or "
                "parallel.stages_per_rank."
            )
        cls.cut_layout(cfg, model_config)  # a parallel.pp_split list that does not add up to the layers
        super().validate_model(cfg, model_config)  # NF4 blocks that shard (fsdp+pp's QLoRA)

    # -- set-up --------------------------------------------------------------------------------
    def pipelines(self) -> list[list[int]]:
        """Global ranks of every pipeline, each indexed by pipeline rank (pp: one, the world)."""
        return [list(range(self.env.world_size))]

    def pipeline_group(self) -> dist.ProcessGroup | None:
        """The process group of this rank's pipeline (None: the default group)."""
        return None

    def parallelize(self, model: nn.Module) -> nn.Module:
        self.layout, self.costs = self.cut_layout(self.cfg, model.backbone.config, self.label_tokens)
        lay = self.layout
        pipelines = self.pipelines()
        # This rank's pipeline (global ranks by pipeline rank) and its place in it. Layout methods
        # speak pipeline ranks; p2p outside the schedule (evaluation) maps them through pp_ranks.
        self.pp_ranks = next(ranks for ranks in pipelines if self.env.rank in ranks)
        self.pp_rank = rank = self.pp_ranks.index(self.env.rank)
        self.pp_group = self.pipeline_group()
        self.stage_ids = lay.stages_of(rank)
        last = lay.num_stages - 1
        # Read before `shard_stage`, which may replace the parameters (FSDP: by sharded DTensors).
        tied = (
            model.backbone.embed_tokens.weight is model.lm_head.weight and model.lm_head.weight.requires_grad
        )
        self.export_names = {n for n, p in model.lm.named_parameters() if p.requires_grad}  # tied: once
        self.stages, view = build_stages(model, lay, rank, self.env.device, self.pp_group, self.shard_stage)
        for stage in self.stages:
            self._probe_first_forward(stage)
        self.holds_first, self.holds_last = 0 in self.stage_ids, last in self.stage_ids
        self.schedule = build_schedule(lay, self.stages, self._loss)
        self._tie(model, pipelines, tied)
        self._warm_up()
        return view

    def shard_stage(self, module: nn.Module, stage: int) -> None:
        """Shard one stage's module in place before torch wraps it (`pp`: nothing; fsdp+pp: FSDP2)."""

    def _tie(self, model: nn.Module, pipelines: list[list[int]], tied: bool) -> None:
        """Tied embedding / lm_head on two ranks (full finetuning): each copy gets its stage's part of
        the gradient; `after_backward` sums the two so both copies take the same step and stay equal."""
        lay = self.layout
        first_rank, last_rank = lay.rank_of(0), lay.rank_of(lay.num_stages - 1)
        self.tied_weight: nn.Parameter | None = None
        self.tie_group = None
        if tied and first_rank != last_rank:
            for ranks in pipelines:  # one pair per pipeline; every rank takes part in creating each
                group = dist.new_group([ranks[first_rank], ranks[last_rank]])
                if self.env.rank in ranks:
                    self.tie_group = group
            if self.pp_rank in (first_rank, last_rank):  # this rank's copy, as its stage holds it
                owner = model.backbone.embed_tokens if self.holds_first else model.lm_head
                self.tied_weight = owner.weight

    def _probe_first_forward(self, stage: PipelineStage) -> None:
        """Run the first micro-batch's forward under the loop's activation probe, when it sets one."""
        original = stage.forward_one_chunk

        def forward_one_chunk(chunk: int, *args, **kwargs):
            probe = self.activation_probe if chunk == 0 else None
            if probe is None:
                return original(chunk, *args, **kwargs)
            with probe:
                return original(chunk, *args, **kwargs)

        stage.forward_one_chunk = forward_one_chunk

    def _warm_up(self) -> None:
        """One step on an all-padding batch: it builds the stage shapes and the p2p channels.

        torch's stages infer their input/output shapes on the first step, sending metadata between
        ranks; doing it here keeps that traffic out of the first counted step. No label carries loss,
        so every gradient is exactly zero; they are dropped, and the RNG is restored.
        """
        lay, length = self.layout, self.cfg.data.max_length
        blank = Example([0] * length, [-100] * length, 0)  # the shape of every real batch, no loss
        rows = lay.micro_batch_size * rows_per_item(self.cfg.train.objective)
        batch = micro_batch([blank] * rows, 0, self.cfg.data.packing) | blank_preference(self.cfg, rows)
        batches = [{k: v.to(self.env.device) for k, v in batch.items()} for _ in range(lay.microbatches)]
        with torch.random.fork_rng(devices=[]):
            self._run(batches, num_label_tokens=1)
        for stage in self.stages:
            stage.submod.zero_grad(set_to_none=True)
        lm = self.stages[-1].submod.loss_lm
        for statistics in (lm.preference, lm.router):  # the blank rows' (an MoE's: on every rank)
            if statistics is not None:
                statistics.take_stats(self.env.device)

    # -- one step ------------------------------------------------------------------------------
    def _loss(self, loss_sum: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Last stage, per micro-batch: the stage already summed the token losses; scale to the global mean."""
        self._loss_sums.append(loss_sum.detach())
        return loss_sum.sum() * self.loss_scale / self._num_label_tokens

    def _run(self, micro_batches: list[Batch], num_label_tokens: int) -> torch.Tensor:
        """One `schedule.step()` over the whole batch; the loss sum this rank's last stage computed."""
        batch = full_batch(micro_batches, self.cfg, self.layout)
        self._num_label_tokens = num_label_tokens
        self._loss_sums: list[torch.Tensor] = []
        args = (batch["input_ids"],) if self.holds_first else ()
        target = batch["labels"] if self.holds_last else None
        masks = {k: v for k, v in batch.items() if k != "input_ids"}  # labels, the mask or positions
        self.schedule.step(*args, **masks, target=target, return_outputs=False)
        total = torch.zeros((), device=self.env.device)
        for loss_sum in self._loss_sums:
            total += loss_sum.float().sum()
        return total

    def forward_backward(
        self, model: nn.Module, micro_batches: list[Batch], num_label_tokens: int
    ) -> torch.Tensor:
        total = self._run(micro_batches, num_label_tokens)
        self.after_backward(model)
        return total

    def after_backward(self, model: nn.Module) -> None:
        if self.tied_weight is not None and self.tied_weight.grad is not None:
            dist.all_reduce(local(self.tied_weight.grad), group=self.tie_group)  # FSDP: shard by shard

    @torch.no_grad()
    def forward_only(self, model: nn.Module, micro_batches: list[Batch]) -> torch.Tensor:
        """Evaluation: each micro-batch passes the stages in order, with blocking sends between ranks.

        Not torch's `schedule.eval()`: that fails for V-shaped placements and re-initialises the
        stages (a metadata exchange) on every switch between training and evaluation. Speed does
        not matter here; this path is sequential, plain and the same for every schedule.
        """
        batch = full_batch(micro_batches, self.cfg, self.layout)
        chunks = {k: v.chunk(self.layout.microbatches) for k, v in batch.items()}
        total = torch.zeros((), device=self.env.device)
        for i in range(self.layout.microbatches):
            out = self._through_stages(model, {k: c[i] for k, c in chunks.items()})
            if out is not None:
                total += out.float().sum()
        return total

    @torch.no_grad()
    def scores(self, model: nn.Module, micro_batches: list[Batch]) -> torch.Tensor:
        """Each sequence's value from the last stage's scoring head, through the stages in order as
        in `forward_only` (any shape: no schedule); zeros on the ranks without the last stage."""
        values = []
        for batch in micro_batches:
            out = self._through_stages(model, batch)
            n = labelled_sequences(batch["labels"], batch.get("position_ids"))
            values.append(out.float() if out is not None else torch.zeros(n, device=self.env.device))
        return torch.cat(values)

    def _through_stages(self, model: nn.Module, batch: Batch) -> torch.Tensor | None:
        """One micro-batch through this rank's stages, with blocking sends between ranks: the last
        stage's output on the rank that holds it, else None."""
        lay, me, ranks = self.layout, self.pp_rank, self.pp_ranks
        hidden_size = model.module.backbone.config.hidden_size
        dtype = next(self.stages[0].submod.parameters()).dtype
        modules = {stage.stage_index: stage.submod for stage in self.stages}
        ids, masks = batch["input_ids"], {k: v for k, v in batch.items() if k != "input_ids"}
        x = ids
        for s in self.stage_ids:
            if s > 0 and lay.rank_of(s - 1) != me:
                x = torch.empty((*ids.shape, hidden_size), dtype=dtype, device=self.env.device)
                dist.recv(x, src=ranks[lay.rank_of(s - 1)])
            x = modules[s](x, **masks)
            if s == lay.num_stages - 1:
                return x
            if lay.rank_of(s + 1) != me:
                dist.send(x.to(dtype).contiguous(), dst=ranks[lay.rank_of(s + 1)])
        return None

    def traffic_facts(self, model: nn.Module) -> dict:
        """The cut as it ran (the planner's would cut by its own labelled-position estimate)."""
        return {"pp_split": self.layout.layers_per_stage}

    # -- gradients and export ------------------------------------------------------------------
    def gradient_shares(self, model: nn.Module) -> tuple[list[tuple[torch.Tensor, int]], list[torch.Tensor]]:
        """Every gradient of this rank's stages is its share of the pipeline's, summed over the
        pipeline group (data-parallel replicas hold equal gradients and are not counted twice). A
        tied embedding split over two ranks is held, summed, by both: each counts half. Sharded
        gradients (fsdp+pp) count each shard once (`grad_copies`)."""
        return [
            (g, (self.grad_copies(g) if isinstance(g, DTensor) else 1) * (2 if p is self.tied_weight else 1))
            for p in model.parameters()
            if (g := p.grad) is not None
        ], []

    def norm_group(self) -> dist.ProcessGroup | None:
        return self.pp_group

    def trained_names(self, model: nn.Module) -> set[str]:
        """The view's: a tied lm_head on its own rank is listed under its name there."""
        return {name for name, p in model.named_parameters() if p.requires_grad}

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        # A tied lm_head is written as one process writes it: under the embedding's name.
        return single_model_state(super().checkpoint_state(model, optimizer), model)

    def load_checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        super().load_checkpoint_state(model, optimizer, single_model_state(state, model, single=False))

    def reduce_loss(self, local_sum: torch.Tensor) -> torch.Tensor:
        """Only the last stage's rank has a loss; a sum over ranks gives it to everyone."""
        return summed(local_sum)

    def trainable_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Every rank's trained parameters, gathered on rank 0 under the single model's names.

        Sharded ones (fsdp+pp) are gathered whole first, a collective over the ranks sharing the
        stage; only one of them (`exports_stage`) copies the result to the host and sends it on."""
        exports, mine = self.exports_stage(), {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                whole = self.whole_parameter(p)  # every rank joins the gather
                if exports:
                    mine[name.removeprefix("lm.")] = whole.detach().cpu().clone()
        gathered: list[dict | None] | None = [None] * self.env.world_size if self.env.is_main else None
        dist.gather_object(mine, gathered, dst=0)
        if not self.env.is_main:
            return None
        # The single model lists a tied lm_head once, as the embedding: keep its names only.
        state = {}
        for part in gathered:
            state.update({n: t for n, t in part.items() if n in self.export_names})
        return state

    def exports_stage(self) -> bool:
        """This rank sends its stages' weights to the export (`pp`: every rank holds its own)."""
        return True

    def actions(self) -> list[list[Action]]:
        """Each pipeline rank's F/B/W passes in the order this schedule runs them."""
        return schedule_actions(self.layout, self.schedule)
