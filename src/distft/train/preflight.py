"""What `distft train` checks before it launches anything, in the launching process: the devices
for `--nproc` (bfloat16 and model.fp8 on them), the run directory (a resume, a finished run, room
to write), the trackers and the optimizer, the model's weight files and architecture against the
strategy, and every data row."""

from __future__ import annotations

import os
import sys

from distft.config import Config
from distft.errors import ConfigError
from distft.health.cuda import check_bf16
from distft.io.checkpoint import check_resume
from distft.io.preflight import check_finished_run, check_output_dir
from distft.model.build import architecture
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


def _cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
