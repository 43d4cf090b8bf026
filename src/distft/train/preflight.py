"""What `distft train` checks before it launches anything, in the launching process: the devices
for `--nproc` (bfloat16 and model.fp8 on them), the run directory (a resume, a finished run, room
to write), the trackers and the optimizer, the model's weight files and architecture against the
strategy, and every data row; and the settings this run would not read, said."""

from __future__ import annotations

import os
import sys

from distft.config import Config
from distft.config.choices import WITH_REFERENCE
from distft.config.io import override_value
from distft.errors import ConfigError
from distft.health.cuda import check_bf16
from distft.io.checkpoint import check_resume
from distft.io.preflight import check_finished_run, check_output_dir
from distft.model import is_preset
from distft.model.build import architecture
from distft.model.families import family_of
from distft.model.files import check_weight_files
from distft.model.fp8 import check_fp8_hardware
from distft.model.start import check_init_adapter
from distft.parallel import check_model
from distft.text import plural
from distft.train.optim import check_optimizer
from distft.train.prepare import prepare_data
from distft.train.tracking import check_trackers


def preflight(cfg: Config, resuming: bool = False) -> float | None:
    """Everything that can be checked without training: devices, the output directory, the model
    architecture and every data row (their mean labelled positions returned)."""

    if cfg.train.device == "cuda" and _cuda_count() == 0:
        raise ConfigError(
            "train.device=cuda, but this machine has no CUDA device; use train.device=cpu or auto."
        )
    on_cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and _cuda_count() > 0)
    if on_cuda and cfg.parallel.nproc > _cuda_count():
        raise ConfigError(
            f"--nproc {cfg.parallel.nproc} asks for more processes than the {plural(_cuda_count(), 'GPU')} on this "
            "node; each process needs its own GPU."
        )
    if on_cuda:
        check_bf16(cfg.model, cfg.parallel.nproc)  # bfloat16 needs compute capability 8.0
    check_fp8_hardware(cfg.model.fp8, "cuda" if on_cuda else "cpu", cfg.parallel.nproc)  # sm89+
    check_resume(cfg)
    check_trackers(cfg)  # output.report_to: each tracker's library is installed
    check_optimizer(cfg, "cuda" if on_cuda else "cpu")  # adamw-8bit: bitsandbytes, and it runs here
    check_finished_run(cfg, resuming)  # after check_resume: a foreign config is named first
    check_weight_files(cfg.model)
    model = architecture(cfg.model)  # rotary embeddings as model.rope_scaling stretches them
    check_model(cfg, model)
    for line in unread_settings(cfg, model):  # valid, but nothing reads them in this run
        print(f"distft train: warning: {line}", file=sys.stderr)
    check_output_dir(cfg, model)
    check_init_adapter(cfg)
    if not on_cuda and cfg.parallel.nproc > (cores := _cpu_cores()):  # said once the setup is known to run
        print(
            f"distft train: warning: --nproc {cfg.parallel.nproc} on {plural(cores, 'CPU core')}: the processes "
            "take turns on the cores, so every step waits on the slowest; right for checking a layout, "
            f"slow for training (at most {cores} for speed)",
            file=sys.stderr,
        )
    return prepare_data(cfg)


# The [dpo] settings each objective reads (`distft.model.preference`, `distft.train.reference`).
READ_BY_OBJECTIVE = {
    "beta": ("dpo", "orpo", "kto"),
    "loss_type": ("dpo",),
    "label_smoothing": ("dpo",),
    "desirable_weight": ("kto",),
    "undesirable_weight": ("kto",),
    "precompute_reference": WITH_REFERENCE,
    "max_prompt_length": ("dpo", "orpo", "kto"),
    "max_completion_length": ("dpo", "orpo", "kto"),
}


def unread_settings(cfg: Config, model: object) -> list[str]:
    """A line for each setting moved from its default that this run never reads: a [dpo] setting
    its objective has no use for, an [moe] one on a model without experts, trust_remote_code on a
    preset (built from transformers' own code). The strategy's own: `distft.layout.ignored_settings`."""
    defaults, objective, lines = Config(), cfg.train.objective, []
    for key, readers in READ_BY_OBJECTIVE.items():
        value = getattr(cfg.dpo, key)
        if objective not in readers and value != getattr(defaults.dpo, key):
            who = f"only {', '.join(readers)} {'read' if len(readers) > 1 else 'reads'} it"
            lines.append(
                f"dpo.{key}={override_value(value)} does nothing under train.objective={objective}: {who}."
            )
    if not family_of(model, cfg.model.name).moe:
        for key in ("aux_loss_coef", "z_loss_coef"):
            if (value := getattr(cfg.moe, key)) != getattr(defaults.moe, key):
                lines.append(f"moe.{key}={value:g} does nothing: {cfg.model.name} has no mixture of experts.")
    if cfg.model.trust_remote_code and is_preset(cfg.model.name):
        lines.append(
            f"model.trust_remote_code=true does nothing: the preset {cfg.model.name} is built from "
            "transformers' own code, and no other code runs."
        )
    return lines


def _cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
