"""The optimizer and the learning-rate schedule a run steps, both named in `optim`.

- `optim.name`: adamw (torch's; fused on CUDA), adamw-8bit (bitsandbytes' `AdamW8bit`: its two
  moments in 8 bits, block-quantized; optional, checked before launch by `check_optimizer`) or sgd
  (torch's, with `optim.momentum`: one buffer per parameter, none at momentum 0).
- LoRA+ (`lora.lr_ratio`, Hayou et al. 2402.12354): the lora_B matrices form a param group of their
  own at lr x ratio. peft's `create_loraplus_optimizer` builds the optimizer itself, which would
  bypass `Strategy.build_optimizer` (ZeRO-1 wraps it); the two groups are built here instead and the
  strategy builds over them. Every group follows the same schedule: LambdaLR scales each group's
  own initial learning rate.
- `optim.scheduler`: linear warm-up over `warmup_steps` (`optim.warmup_ratio` of the run, or
  `optim.warmup_steps`), then cosine or linear decay to
  `min_lr_ratio` of the peak at the last step, or constant.
- `lr_scaling_hint`: the learning rate a recipe tuned at another global batch would scale to (square
  root for Adam, Malladi et al. 2205.10287; linear for SGD, Goyal et al. 1706.02677). Printed, never
  applied.
"""

from __future__ import annotations

import importlib
import importlib.util
import math

import torch
from torch import nn

from distft.config import Config
from distft.config.choices import ITEM_NAMES
from distft.errors import ConfigError
from distft.parallel import Strategy, master_weights
from distft.text import plural


def warmup_steps(cfg: Config) -> int:
    """Steps of linear warm-up: `optim.warmup_ratio` of the run (rounded up) when set, else
    `optim.warmup_steps`."""
    if cfg.optim.warmup_ratio > 0:
        return math.ceil(cfg.optim.warmup_ratio * cfg.train.max_steps)
    return cfg.optim.warmup_steps


def warmup_warning(cfg: Config) -> str | None:
    """A warm-up as long as the run keeps the learning rate below the one it was given: said before
    launch. (One warm-up step is none: the first step runs at the peak.)"""
    warmup, total = warmup_steps(cfg), cfg.train.max_steps
    if warmup <= 1 or warmup < total:
        return None
    reaches = "only on the last step" if warmup == total else "never"
    return (
        f"optim.warmup_steps={warmup} is as long as the run ({plural(total, 'step')}): the learning rate "
        f"reaches optim.lr={cfg.optim.lr:g} {reaches}; set optim.warmup_ratio (e.g. 0.1) or fewer warm-up steps"
    )


def lr_lambda(cfg: Config):
    """Linear warm-up to the peak, then `optim.scheduler` (cosine, linear, constant) to the last step."""
    warmup, total, floor = warmup_steps(cfg), cfg.train.max_steps, cfg.optim.min_lr_ratio
    kind = cfg.optim.scheduler

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min((step - warmup) / max(1, total - warmup - 1), 1.0)
        if kind == "linear":
            return floor + (1 - floor) * (1 - progress)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def param_groups(model: nn.Module, cfg: Config) -> list[dict]:
    """The trainable parameters, in one group, or two under LoRA+ (lora_B at lr x lora.lr_ratio)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if cfg.lora.lr_ratio == 1.0:
        return [{"params": [p for _, p in named]}]
    b = [p for n, p in named if ".lora_B." in n]
    rest = [p for n, p in named if ".lora_B." not in n]
    groups = [{"params": rest}, {"params": b, "lr": cfg.optim.lr * cfg.lora.lr_ratio}]
    return [g for g in groups if g["params"]]  # a pipeline stage may hold no lora_B


def build_optimizer(model: nn.Module, cfg: Config, strategy: Strategy) -> torch.optim.Optimizer:
    """`optim.name` over the trainable parameters, built by the strategy (ZeRO-1 partitions it)."""
    groups, o = param_groups(model, cfg), cfg.optim
    if o.name == "sgd":
        return strategy.build_optimizer(
            groups, torch.optim.SGD, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay
        )
    adam = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps, "weight_decay": o.weight_decay}
    if o.name == "adamw-8bit":
        return strategy.build_optimizer(
            groups, importlib.import_module("bitsandbytes.optim").AdamW8bit, **adam
        )
    # Fused: one kernel for every tensor when they are all on CUDA, where the per-tensor loop
    # would launch several kernels per parameter.
    on_cuda = all(p.device.type == "cuda" for g in groups for p in g["params"])
    fused = o.fused == "true" or (o.fused == "auto" and on_cuda)
    # fused=None: torch's default (the for-loop; foreach on CUDA)
    return strategy.build_optimizer(groups, torch.optim.AdamW, fused=True if fused else None, **adam)


def check_optimizer(cfg: Config, device: torch.device | str) -> None:
    """Before launch: adamw-8bit needs bitsandbytes, installed and able to step on `device`."""
    if cfg.optim.name != "adamw-8bit":
        return
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(
            "optim.name=adamw-8bit needs bitsandbytes (`pip install bitsandbytes`), which is not installed. "
            "Use optim.name=adamw (the same update with 32-bit moments), or install it."
        )
    try:  # a two-element step: the CPU build of some versions imports but has no 8-bit kernels
        weight = torch.nn.Parameter(torch.ones(4096, device=device))
        weight.grad = torch.ones_like(weight)
        importlib.import_module("bitsandbytes.optim").AdamW8bit([weight], lr=1e-3).step()
    except Exception as err:  # any failure means it cannot run here
        raise ConfigError(
            f"optim.name=adamw-8bit: bitsandbytes is installed but its 8-bit AdamW cannot step on "
            f"{torch.device(device).type} ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). "
            "Use optim.name=adamw, or run where bitsandbytes has kernels (CUDA)."
        ) from None


def epoch_steps(cfg: Config, rows: int) -> int:
    """Optimizer steps of `train.epochs` passes over `rows` training rows, the last one partial."""
    return max(1, math.ceil(cfg.train.epochs * rows / cfg.train.global_batch_size))


def training_lines(cfg: Config, rows: int) -> list[str]:
    """The header's lines on how the run trains: optimizer and schedule, the LoRA variant, the
    length from epochs, the master weights, and the learning-rate hint."""
    o, t, lora = cfg.optim, cfg.train, cfg.lora
    extra = f", momentum {o.momentum:g}" if o.name == "sgd" else ""
    warmup = warmup_steps(cfg)
    share = f" ({o.warmup_ratio:g} of the run)" if o.warmup_ratio > 0 else ""
    lines = [
        f"optimizer {o.name} (lr {o.lr:g}{extra}), {plural(warmup, 'warm-up step')}{share} then {o.scheduler}"
        + (f" to {o.min_lr_ratio:g} x lr" if o.scheduler != "constant" else "")
        + f", {t.max_steps} steps"
    ]
    if t.epochs > 0:
        lines.append(
            f"train.epochs={t.epochs:g}: max_steps {t.max_steps} = ceil({t.epochs:g} x {rows} "
            f"{ITEM_NAMES[t.objective]}s / "
            f"global batch {t.global_batch_size})"
        )
    if t.method != "full" and (lora.variant != "lora" or lora.lr_ratio != 1.0):
        plus = f"; LoRA+: lora_B at lr x {lora.lr_ratio:g}" if lora.lr_ratio != 1.0 else ""
        lines.append(
            f"adapters: {lora.variant}, rank {lora.rank}, targets {', '.join(lora.target_modules)}{plus}"
        )
    if t.method == "full" and cfg.model.dtype == "bfloat16":
        lines.append(
            "master weights fp32: fp32 weights, gradients and optimizer state, bf16 compute"
            if master_weights(cfg) == "fp32"
            else "master weights: none (bf16 weights, gradients and optimizer state; train.master_weights=model)"
        )
    if warning := warmup_warning(cfg):
        lines.append(f"warning: {warning}")
    hint = lr_scaling_hint(cfg)
    return [*lines, f"hint: {hint}"] if hint else lines


def lr_scaling_hint(cfg: Config) -> str | None:
    """One header line when `optim.tuned_global_batch_size` is set and differs from the run's batch."""
    tuned, batch = cfg.optim.tuned_global_batch_size, cfg.train.global_batch_size
    if not tuned or tuned == batch:
        return None
    ratio = batch / tuned
    if cfg.optim.name == "sgd":
        rule, scaled = "linear scaling (SGD)", cfg.optim.lr * ratio
    else:
        rule, scaled = "square-root scaling (Adam)", cfg.optim.lr * math.sqrt(ratio)
    return (
        f"optim.lr={cfg.optim.lr:g} was tuned for a global batch of {tuned}, this run's is {batch}: "
        f"{rule} suggests optim.lr={scaled:.3g} (not applied)"
    )
