"""A run the plan says does not fit: refused before launch, with the planner's own choice for the
same processes (`distft train`; `--force` launches it anyway, said as a warning)."""

from __future__ import annotations

from distft.config import Config
from distft.errors import ConfigError
from distft.plan.auto import device_words, request_for
from distft.plan.decide import decide
from distft.plan.hardware import format_bytes
from distft.text import plural


def check_fits(cfg: Config, force: bool) -> str | None:
    """Refuse a run the plan says does not fit, with the planner's own choice for this machine
    (`ConfigError`, before launch); with `force`, the warning to print instead. None: it fits, or
    the planner cannot model it."""
    prediction = cfg.prediction
    if prediction is None or prediction["fits"] or not prediction.get("modelled", True):
        return None
    need, usable = format_bytes(prediction["peak_mem_bytes"]), format_bytes(prediction["usable_bytes"])
    parts = sorted(prediction["by_component"].items(), key=lambda kv: -kv[1])[:2]
    largest = " and ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in parts)
    said = (
        f"the plan says this run does NOT fit: {need} per process at the fullest ({largest} the largest) "
        f"in {usable} usable ({prediction['device']})"
    )
    if force:
        return f"{said}; launched anyway (--force)"
    raise ConfigError(f"{said}. {_advice(cfg)} Add --force to launch it anyway.")


def _advice(cfg: Config) -> str:
    """The planner's choice for this model on these processes, or what it found nothing fits."""
    try:
        req, _ = request_for(cfg)
        rec = decide(req)
    except ConfigError:
        return "`distft plan` explains the estimate."
    reason = device_words(cfg, rec.reason)
    if rec.strategy is None:
        return f"The planner finds nothing that fits {plural(cfg.world_size, 'process')} here: {reason}"
    checkpointing = f" model.activation_checkpointing={rec.activation_checkpointing}"
    return (
        f"The planner's choice for {plural(cfg.world_size, 'process')} here: --strategy {rec.strategy} "
        f"--method {rec.method}{checkpointing if rec.activation_checkpointing != 'none' else ''} "
        f"(--strategy auto takes it): {reason}"
    )
