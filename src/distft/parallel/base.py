"""The `Strategy` interface: the one seam between the training loop and a parallel strategy.

The loop in `distft.train` never asks which strategy it runs. It asks the strategy to:
- check a config and a model architecture before any process starts (`validate_config`,
  `validate_model`), and say how many data-parallel replicas there are (`data_parallel_size`);
- wrap the model (`parallelize`) and run forward + backward over this rank's micro-batches
  (`forward_backward`), which is where DDP defers its all-reduce and a pipeline runs its schedule;
- combine per-rank loss sums (`reduce_loss`) and gather the trained weights into the single-model
  layout on rank 0 (`trainable_state_dict`), so every strategy exports the same PEFT adapter;
- build the optimizer (`build_optimizer`: ZeRO-1 partitions its state) and present weights and
  optimizer state to `torch.distributed.checkpoint` and take them back (`checkpoint_state`,
  `load_checkpoint_state`), shards as DTensors so DCP can reshard them.

The defaults below are the single-process behaviour; a strategy overrides only what it changes.
"""

from __future__ import annotations

import contextlib
import math
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig

from distft.config import Config
from distft.distributed import DistEnv
from distft.layout import SPECS, ParallelDims, StrategySpec
from distft.model.nf4 import NF4Spec, check_quantizable
from distft.parallel.dims import mesh_groups
from distft.parallel.grads import clip_grad_norm_

Batch = dict[str, torch.Tensor]  # input_ids, attention_mask, labels: each (micro_batch, seq)


class Strategy:
    name: ClassVar[str]
    # What the strategy is (its dimensions, what it shards, what it runs and why not): its
    # `distft.layout.StrategySpec`, `SPECS[name]`, set for each class that names itself. The class
    # holds only how it runs.
    spec: ClassVar[StrategySpec]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            cls.spec = SPECS[cls.name]

    pp_rank: int = 0  # this rank's place in its pipeline (a pipeline sets it; 0 without one)

    # -- before launch: pure functions of the config -----------------------------------------
    @classmethod
    def validate_config(cls, cfg: Config) -> None:
        """Raise ConfigError for combinations this strategy cannot run."""

    @classmethod
    def validate_model(cls, cfg: Config, model_config: PretrainedConfig) -> None:
        """Raise ConfigError when the architecture cannot be split this way."""
        if cfg.train.method == "qlora":
            check_quantizable(NF4Spec.from_config(cfg.model), model_config, shards=cls.nf4_shards(cfg))

    @classmethod
    def nf4_shards(cls, cfg: Config) -> int:
        """How many ways each NF4 base weight is split (FSDP: its degree)."""
        return 1

    @classmethod
    def micro_batch_size(cls, cfg: Config) -> int:
        """Sequences per forward/backward on one rank (a pipeline derives it from its micro-batch count)."""
        return cfg.train.micro_batch_size

    @classmethod
    def data_parallel_size(cls, cfg: Config) -> int:
        """How many ranks read distinct data (the global batch is split this many ways): the
        data-parallel dimensions of its layout (`ParallelDims.dp`)."""
        return ParallelDims.of(cls.spec, cfg).dp

    # -- in each process ---------------------------------------------------------------------
    def __init__(self, cfg: Config, env: DistEnv):
        self.cfg = cfg
        self.env = env
        # Set by the loop for one step: wraps the first micro-batch's forward (activation bytes).
        self.activation_probe: contextlib.AbstractContextManager | None = None
        # Set by the loop's set-up before `parallelize`: the mean labelled positions per training
        # row (None: not measured). A pipeline cuts its stages by the cost of lm_head on them.
        self.label_tokens: float | None = None
        self.dims = ParallelDims.of(self.spec, cfg)  # the degrees of its mesh (`distft.layout`)
        self.dp_size = self.dims.dp
        self.dp_rank = self.dims.coordinates(env.rank)["dp"]
        # Ranks whose gradients the wrapper averages (DDP, FSDP: the replicas): each scales its loss up by as many.
        self.averaged_over = self.dp_size

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Place and wrap the `LossLM`; the returned module's forward gives the loss sum."""
        return model.to(self.env.device)

    def accumulating(self, model: nn.Module, last_micro_batch: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's forward+backward (DDP skips its all-reduce until the last)."""
        return contextlib.nullcontext()

    def forward_backward(
        self, model: nn.Module, micro_batches: list[Batch], num_label_tokens: int
    ) -> torch.Tensor:
        """Accumulate gradients of (global loss) over this rank's micro-batches; return the local loss sum.

        The global loss is the sum of token losses over the whole global batch divided by its
        number of labelled tokens, whatever the split across ranks and micro-batches. Data-parallel
        wrappers average gradients over replicas, so each replica scales its part by their count.
        """
        scale = self.averaged_over / num_label_tokens
        total = torch.zeros((), device=self.env.device)
        for i, batch in enumerate(micro_batches):
            with self.accumulating(model, last_micro_batch=i == len(micro_batches) - 1):
                with self.activation_probe if i == 0 and self.activation_probe else contextlib.nullcontext():
                    loss_sum = model(**batch)
                (loss_sum * scale).backward()
            total += loss_sum.detach().float()
        self.after_backward(model)
        return total

    def after_backward(self, model: nn.Module) -> None:
        """Fix-ups between backward and the optimizer step (e.g. TP's partial gradients)."""

    def release_gathered(self, model: nn.Module) -> None:
        """After forwards outside a step (evaluation, a reference scored before step 1): free what
        they gathered and kept (FSDP without reshard after forward), so that the next step gathers
        as every step does."""

    @torch.no_grad()
    def forward_only(self, model: nn.Module, micro_batches: list[Batch]) -> torch.Tensor:
        """The local loss sum over micro-batches without gradients (evaluation)."""
        total = torch.zeros((), device=self.env.device)
        for batch in micro_batches:
            total += model(**batch).float()
        return total

    @torch.no_grad()
    def scores(self, model: nn.Module, micro_batches: list[Batch]) -> torch.Tensor:
        """Each sequence's value from the scoring head (`LossLM.scoring`: a preference objective's
        log-probabilities, or KTO's log-ratios), the micro-batches in order; a rank without the head
        (a pipeline's earlier stages) gives zeros, so `reduce_loss` sums them as it sums a loss."""
        return torch.cat([model(**batch).float() for batch in micro_batches])

    def build_optimizer(
        self,
        params: list[nn.Parameter] | list[dict],
        optimizer_class: type[torch.optim.Optimizer],
        **defaults,
    ) -> torch.optim.Optimizer:
        """The optimizer over the trainable `params`, or param groups (LoRA+), `distft.train.optim`
        (ZeRO-1 wraps it to partition its state)."""
        return optimizer_class(params, **defaults)

    def local_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer whose `state` this rank holds (ZeRO-1: the one over its partition)."""
        return optimizer

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm and return it (before clipping, on the device): `distft.parallel.grads`."""
        shared, replicated = self.gradient_shares(model)
        return clip_grad_norm_(shared, replicated, max_norm, self.env.device, group=self.norm_group())

    def norm_group(self) -> dist.ProcessGroup | None:
        """The ranks whose shared gradient squares sum to the norm (None: every rank; a pipeline:
        its own ranks, data-parallel replicas hold equal gradients)."""
        return None

    def gradient_shares(self, model: nn.Module) -> tuple[list[tuple[torch.Tensor, int]], list[torch.Tensor]]:
        """Where each gradient element lives, for the norm: (shared, replicated) as
        `grads.clip_grad_norm_` takes them. Sharded gradients (DTensors) are summed over ranks, each
        divided by the number of ranks holding the same shard, so every element counts once."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        shared = [(g, self.grad_copies(g)) for g in grads if isinstance(g, DTensor)]
        return shared, [g for g in grads if not isinstance(g, DTensor)]

    def grad_copies(self, g: DTensor) -> int:
        """How many ranks hold this same gradient shard (counted once in the norm): the sizes of
        the mesh dimensions it is replicated over."""
        return math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_replicate())

    def reduce_loss(self, local_sum: torch.Tensor) -> torch.Tensor:
        """Sum of the loss over the global batch, known on every rank."""
        return summed(local_sum) if self.env.distributed and self.dp_size > 1 else local_sum

    def trainable_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Trained weights in the unwrapped model's names (`LossLM.lm`), full, on CPU, on rank 0.

        Sharded parameters (DTensors: FSDP, TP) are gathered one by one, trainable ones only, so
        exporting a LoRA adapter never materialises the frozen base on one rank.
        """
        state = {}
        for name, param in unwrap(model).lm.named_parameters():
            if param.requires_grad:
                full = self.whole_parameter(param)
                if self.env.is_main:
                    state[name] = full.detach().cpu().clone()
        return state if self.env.is_main else None

    def whole_parameter(self, p: torch.Tensor) -> torch.Tensor:
        """`p` unsplit, as one process holds it: a DTensor gathered (a collective over its mesh)."""
        return p.full_tensor() if isinstance(p, DTensor) else p

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Trainable weights and optimizer state as `torch.distributed.checkpoint` saves and loads
        them: keyed by the single-model names, sharded tensors as DTensors (FSDP and TP parameters
        already are), replicated ones as plain tensors (written once). Frozen weights are left out."""
        model_state, optim_state = get_state_dict(model, optimizer, options=state_dict_options())
        # `LossLM` reaches the same modules as `lm.*` and as `backbone.*` / `lm_head.*`, and
        # `state_dict()` lists every alias; `ignore_frozen_params` drops only the first name of a
        # frozen weight. Keep one name per trainable parameter, or every checkpoint would carry
        # the whole frozen base (and full finetuning's weights twice).
        trainable = self.trained_names(model)
        model_state = {k: v for k, v in model_state.items() if k in trainable}
        # bitsandbytes (0.50) nests a tensor's 8-bit state under one key in its state_dict, but not
        # in its live state, whose names loading follows: kept flat, as it loads.
        optim_state = {k.replace(f".{BNB_STATE}.", "."): v for k, v in optim_state.items()}
        # Flattened optimizer state: `state.<fqn>.<exp_avg|exp_avg_sq|step>` (state_dict_options).
        optimized = {optimizer_state_owner(k)[0] for k in optim_state if k.startswith("state.")}
        assert optimized <= trainable, "optimizer state under names the model lacks"
        return {"model": model_state, "optim": optim_state}

    def trained_names(self, model: nn.Module) -> set[str]:
        """The names of the trained parameters as the state dicts key them, one per parameter."""
        return {name for name, p in unwrap(model).named_parameters() if p.requires_grad}

    def load_checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Put a `checkpoint_state` dict, loaded by DCP, back into the model and the optimizer."""
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=state_dict_options(),
        )

    def mesh_groups(self) -> dict[str, list[int]]:
        """The global ranks of this rank's group along each dimension of the mesh the strategy
        built (`self.mesh`), flattened ones too, as the process groups hold them: `ranks.json`
        shows which groups stay inside a node. A one-dimensional strategy has no mesh."""
        mesh = getattr(self, "mesh", None)
        return mesh_groups(mesh, getattr(self, "flattened", {})) if mesh is not None else {}

    def traffic_facts(self, model: nn.Module) -> dict:
        """What the bytes formula (`distft.plan.traffic`) needs of this running strategy beyond
        its config: `Parallelism` fields (a pipeline's cut as it ran), or `DDPSettings` ones."""
        return {}


BNB_STATE = "__bnb_optimizer_quant_state__"  # where bitsandbytes nests a tensor's 8-bit state


def summed(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`t` summed over the ranks of `group` (None: every rank), in a new tensor (`reduce_loss`)."""
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def optimizer_state_owner(key: str) -> tuple[str, str]:
    """`state.<fqn>.exp_avg` -> (fqn, "exp_avg") in a flattened optimizer state dict."""
    fqn, _, name = key.removeprefix("state.").rpartition(".")
    return fqn, name


def unwrap(model: nn.Module) -> nn.Module:
    """The `LossLM` under DDP's `.module` (FSDP2 and TP modify the module in place)."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def state_dict_options() -> StateDictOptions:
    # Frozen base weights are rebuilt from the model source on resume; saving them would copy
    # the whole base model into every checkpoint. strict=False because the model then has keys
    # (the frozen ones) that the checkpoint does not (PITFALLS.md: ignore_frozen_params alone
    # still fails strict loading). The optimizer state is flattened to one key per parameter name
    # (`state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`, ...): unflattened, param_groups is one list
    # of names per rank under a single key, which DCP stores once, so ranks that hold different
    # parameters (pipeline stages) would load each other's groups.
    return StateDictOptions(ignore_frozen_params=True, strict=False, flatten_optimizer_state_dict=True)
