"""Defaults that compose: what the user did not set, derived so the strategy's checks pass.

`distft train --strategy S --nproc N` with nothing else must run for every strategy in the
registry. The schema's defaults (a global batch of 8 in micro-batches of 4, `parallel.tp=1`,
`parallel.pp=1`, `parallel.shard=0`, `optim.lr=1e-2`) suit one process on a random preset; here
those the user left unset (`Config.explicit`: a config file, an override or a flag set them) are
fitted to the layout, in this order:

1. the mesh: `parallel.tp` / `parallel.pp` of a multi-dimensional strategy (the smallest degrees,
   2, that it accepts), `parallel.shard` of hsdp on one node (the largest shard group that still
   leaves two replicas);
2. the batch: a pipeline's micro-batch count from its ranks and schedule (at least one
   micro-batch per pipeline rank, so the schedule fills: `parallel.microbatches`); elsewhere the
   micro-batch, so the global batch splits evenly over the data-parallel ranks (the global batch
   is the optimization: it stays what the user, or the single-process default, asked for); only
   when it cannot split, the global batch itself: micro-batch x data-parallel ranks x accumulation;
3. the learning rate (`default_lr`): random presets learn at 1e-2; pretrained checkpoints would be
   wrecked by it;
4. the warm-up: `optim.warmup_ratio` 0.1 when neither it nor `optim.warmup_steps` is set, so a
   5-step run warms up for 1 step and a 1,000-step run for 100.

A value the user set is never changed: its error stays the one they see. Nothing is derived when
the defaults already pass. The result is `Config.derived` (field -> why), one line before launch
and in the run's header. Pure: `check_config` only, no model, no files but a run's lineage.json.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from distft.config import Config
from distft.config.choices import WITH_REFERENCE
from distft.errors import ConfigError
from distft.io.lineage import read_lineage
from distft.layout import SPECS, ParallelDims
from distft.model import is_preset
from distft.parallel.checks import check_config
from distft.parallel.registry import STRATEGIES
from distft.text import plural

# Learning rates (AdamW peak) for a base no one chose one for.
RANDOM_PRESET_LR = 1e-2  # a random tiny/micro learns the sample's words in a few hundred steps
PRETRAINED_LORA_LR = 2e-4  # LoRA/QLoRA on a pretrained checkpoint: the QLoRA paper's, PEFT's usual
PRETRAINED_FULL_LR = 2e-5  # every weight of a pretrained checkpoint: the usual SFT rate, 10x below
DEFAULT_WARMUP_RATIO = 0.1  # a tenth of the run: the usual share (transformers' and axolotl's recipes)


def random_base(model_name: str) -> bool:
    """A random preset, or a model trained from one (a directory with its lineage.json)."""
    if is_preset(model_name) and not Path(model_name).is_dir():
        return True
    return Path(model_name).is_dir() and read_lineage(model_name) is not None


def default_lr(model_name: str, method: str) -> tuple[float, str]:
    """The learning rate for this base and method when none was set, and why."""
    if random_base(model_name):
        return RANDOM_PRESET_LR, "a random-weight preset learns fast"
    if method == "full":
        return PRETRAINED_FULL_LR, "full finetuning of a pretrained checkpoint"
    return PRETRAINED_LORA_LR, f"{method} on a pretrained checkpoint"


def derive_defaults(cfg: Config) -> dict[str, str]:
    """Fill the unset fields `cfg` needs to pass the checks before launch (in place); field -> why.

    When nothing derived makes the checks pass, `cfg` is left as it came and the caller's
    `check_config` raises the error the user would have seen."""
    derived = dict(cfg.derived)  # `--strategy auto`'s choice, if it ran first
    if "optim.lr" not in cfg.explicit:
        cfg.optim.lr, why = default_lr(cfg.model.name, cfg.train.method)
        derived["optim.lr"] = f"{cfg.optim.lr:g}: {why}, optim.lr not set"
    derived.update(_derive_warmup(cfg))
    if (
        cfg.train.objective in WITH_REFERENCE
        and (cfg.train.method == "full" or cfg.lora.init_adapter or _pipelined(cfg))
        and "dpo.precompute_reference" not in cfg.explicit
    ):
        cfg.dpo.precompute_reference = True
        derived["dpo.precompute_reference"] = (
            "true: --method full trains the base, so the reference is scored first"
            if cfg.train.method == "full"
            else "true: the reference is the base with lora.init_adapter, scored before it trains"
            if cfg.lora.init_adapter
            else "true: no pipeline stage runs the base under disabled adapters inside the schedule"
        )
    if cfg.parallel.strategy not in STRATEGIES or _passes(cfg):
        cfg.derived = derived
        return derived
    for trial in _layouts(cfg):
        notes = _fit_batch(trial)
        if notes is not None:
            for section in ("parallel", "train"):
                setattr(cfg, section, getattr(trial, section))
            derived.update({**_layout_notes(cfg), **notes})
            break
    cfg.derived = derived
    return derived


def _derive_warmup(cfg: Config) -> dict[str, str]:
    """optim.warmup_ratio when no warm-up was set (both set: refused by `load_config`)."""
    if {"optim.warmup_steps", "optim.warmup_ratio"} & cfg.explicit:
        return {}
    cfg.optim.warmup_ratio = DEFAULT_WARMUP_RATIO
    return {"optim.warmup_ratio": f"{DEFAULT_WARMUP_RATIO:g}: a tenth of the run, no warm-up set"}


def complete_defaults(cfg: Config) -> dict[str, str]:
    """`derive_defaults` for a config built in Python (`distft.train.train(cfg)` without the CLI):
    a field changed from its default after `load_config` counts as set, like one on the command line."""
    defaults = Config()
    changed = {
        f"{section}.{f.name}"
        for section in (f.name for f in dataclasses.fields(defaults))
        for f in dataclasses.fields(getattr(defaults, section))
        if getattr(getattr(cfg, section), f.name) != getattr(getattr(defaults, section), f.name)
    }
    cfg.explicit = cfg.explicit | changed
    return derive_defaults(cfg)


def _pipelined(cfg: Config) -> bool:
    spec = SPECS.get(cfg.parallel.strategy)
    return spec is not None and spec.pipelined


def derived_line(cfg: Config) -> str | None:
    """One line naming what was derived and why (the learning rate of a random preset, which is
    the schema's default, and the usual warm-up only in the header)."""
    hidden = {"parallel.strategy", "optim.warmup_ratio"}  # `--strategy auto` prints its own paragraph
    if cfg.optim.lr == RANDOM_PRESET_LR:
        hidden.add("optim.lr")
    shown = {k: v for k, v in cfg.derived.items() if k not in hidden}
    if not shown:
        return None
    return "derived (not set): " + "; ".join(f"{k}={v}" for k, v in shown.items())


# ---- the mesh ------------------------------------------------------------------------------------


def _passes(cfg: Config) -> bool:
    try:
        check_config(cfg)
    except ConfigError:
        return False
    return True


def _layouts(cfg: Config) -> Iterator[Config]:
    """Copies of `cfg` with each mesh the unset degrees allow, smallest degrees first, and within
    each the shard groups of one node, largest first (HSDP's, HSDP x TP's)."""
    par, world = cfg.parallel, cfg.world_size
    spec = SPECS[par.strategy]
    shards = [par.shard]
    if spec.shard_groups and "parallel.shard" not in cfg.explicit and par.nnodes == 1:
        shards = sorted((d for d in range(1, world) if world % d == 0), reverse=True)
    meshes = [(par.tp, par.pp)]
    if spec.sized:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        tps = [par.tp] if "parallel.tp" in cfg.explicit else divisors
        pps = [par.pp] if "parallel.pp" in cfg.explicit else divisors
        meshes = sorted(
            ((t, p) for t in tps for p in pps if world % (t * p) == 0), key=lambda d: (d[0] * d[1], d)
        )
    for (tp, pp), shard in ((mesh, shard) for mesh in meshes for shard in shards):
        trial = copy.deepcopy(cfg)
        trial.parallel.tp, trial.parallel.pp, trial.parallel.shard = tp, pp, shard
        yield trial


def _layout_notes(cfg: Config) -> dict[str, str]:
    par, notes = cfg.parallel, {}
    world = cfg.world_size
    if SPECS[par.strategy].shard_groups and par.shard and "parallel.shard" not in cfg.explicit:
        dims = ParallelDims.of(SPECS[par.strategy], cfg)
        notes["parallel.shard"] = (
            f"{par.shard}: {world} processes on one node as {dims.dp_replicate} replicas of "
            f"{par.shard} shards ({par.strategy} needs 2+ replicas)"
        )
    for dim, what in (("tp", "tensor-parallel"), ("pp", "pipeline")):
        value = getattr(par, dim)
        if SPECS[par.strategy].sized and value > 1 and f"parallel.{dim}" not in cfg.explicit:
            notes[f"parallel.{dim}"] = f"{value}: the smallest {what} degree --strategy {par.strategy} takes"
    return notes


# ---- the batch -----------------------------------------------------------------------------------


def _fit_batch(cfg: Config) -> dict[str, str] | None:
    """Notes for the batch fields set on `cfg` so that its checks pass, or None if none do."""
    if _passes(cfg):
        return {}
    pipelined = hasattr(STRATEGIES[cfg.parallel.strategy], "pipeline_layout")
    return _fit_pipeline(cfg) if pipelined else _fit_data_parallel(cfg)


def _fit_data_parallel(cfg: Config) -> dict[str, str] | None:
    train, explicit = cfg.train, cfg.explicit
    try:
        dp = STRATEGIES[cfg.parallel.strategy].data_parallel_size(cfg)
    except ConfigError:
        return None  # a mesh that does not divide: the next layout
    if "train.micro_batch_size" not in explicit and train.global_batch_size % dp == 0:
        share = train.global_batch_size // dp
        train.micro_batch_size = max(
            d for d in range(1, min(share, train.micro_batch_size) + 1) if share % d == 0
        )
        if _passes(cfg):
            return {
                "train.micro_batch_size": f"{train.micro_batch_size}: the global batch of "
                f"{train.global_batch_size} split over {dp} data-parallel ranks"
            }
    if "train.global_batch_size" not in explicit:
        accumulation = max(1, train.global_batch_size // (train.micro_batch_size * dp))
        train.global_batch_size = train.micro_batch_size * dp * accumulation
        if _passes(cfg):
            return {
                "train.global_batch_size": f"{train.global_batch_size}: micro-batch {train.micro_batch_size} "
                f"x {dp} data-parallel ranks x accumulation {accumulation}"
            }
    return None


def _fit_pipeline(cfg: Config) -> dict[str, str] | None:
    par, train, explicit = cfg.parallel, cfg.train, cfg.explicit
    strategy = STRATEGIES[par.strategy]
    try:
        dp = strategy.data_parallel_size(cfg)
    except ConfigError:
        return None
    ranks = cfg.world_size // dp // (par.tp if strategy.spec.sized else 1)
    unset = {"parallel.microbatches", "train.micro_batch_size"}.isdisjoint(explicit)
    if unset and train.global_batch_size % dp == 0:
        batch = train.global_batch_size // dp  # one replica's share
        for m in range(ranks, batch + 1):  # at least one micro-batch per pipeline rank
            if batch % m == 0:
                par.microbatches = m
                if _passes(cfg):
                    return {
                        "parallel.microbatches": f"{m}: {par.schedule} over {ranks} pipeline ranks needs "
                        f"{ranks}+ micro-batches; {batch} sequences per replica cut into {m} of {batch // m}"
                    }
        par.microbatches = 0
    if "train.global_batch_size" not in explicit and "parallel.microbatches" not in explicit:
        m = max(ranks, par.microbatches)
        train.global_batch_size = dp * m * train.micro_batch_size
        if _passes(cfg):
            return {
                "train.global_batch_size": f"{train.global_batch_size}: {plural(dp, 'pipeline replica')} x {m} "
                f"micro-batches (one per pipeline rank) x micro-batch {train.micro_batch_size}"
            }
    return None


# ---- to the ranks --------------------------------------------------------------------------------

NOTES_ENV = "DISTFT_RUN_NOTES"  # what was derived and predicted, for the ranks' header and ranks.json


@contextmanager
def notes_for_ranks(cfg: Config) -> Iterator[None]:
    """The launched ranks read the config from a file, which holds values, not where they came from:
    `Config.derived`, `Config.prediction` and `Config.calibration` travel in the environment while
    they start."""
    notes = {"derived": cfg.derived, "prediction": cfg.prediction, "calibration": cfg.calibration}
    os.environ[NOTES_ENV] = json.dumps(notes)
    try:
        yield
    finally:
        os.environ.pop(NOTES_ENV, None)


def read_rank_notes(cfg: Config) -> None:
    """In a rank: `Config.derived`, `Config.prediction` and `Config.calibration` as the launching
    command set them."""
    notes = json.loads(os.environ.get(NOTES_ENV) or "{}")
    cfg.derived = notes.get("derived") or {}
    cfg.prediction = notes.get("prediction")
    cfg.calibration = notes.get("calibration")
