"""A run the plan says does not fit: refused before launch, with the planner's own choice for the
same processes (`distft train`; `--force` launches it anyway, said as a warning). And data that
data.max_length cuts for the most part: said before launch, with what the whole rows would cost."""

from __future__ import annotations

import copy

from distft.config import Config
from distft.errors import ConfigError
from distft.measure.flops import StepTime
from distft.model.build import architecture
from distft.model.positions import check_positions
from distft.plan.auto import device_words, predict, request_for
from distft.plan.decide import decide
from distft.plan.hardware import format_bytes, format_seconds
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


def truncation_warning(cfg: Config, summary: dict, label_tokens: float | None) -> str | None:
    """When data.max_length cuts most training rows, or most of their tokens (`summary`: the
    training split's, `distft.data.chat.split_summary`): the length that keeps every token, and
    the plan at it beside the plan at this one. None: most of the data is trained as it is."""
    rows, cut_rows = summary["rows"], summary["truncated_rows"]
    cut = cut_rows * summary["truncated_tokens_mean"]
    whole = summary["tokens_total"] + cut
    if not rows or (2 * cut_rows <= rows and 2 * cut <= whole):
        return None
    longest = summary["tokens_whole_max"]
    said = (
        f"data.max_length={cfg.data.max_length} cuts {cut_rows} of {plural(rows, 'training row')}, "
        f"{cut / whole:.0%} of their tokens (data.truncation={cfg.data.truncation})"
        + (": the model never sees most of the data" if 2 * cut > whole else "")
        + f". data.max_length={longest} keeps every token"
    )
    longer = copy.deepcopy(cfg)
    longer.data.max_length = longest
    try:
        check_positions(architecture(cfg.model), cfg.model.name, longest)
        now, then = predict(cfg, label_tokens), predict(longer, label_tokens)
    except ConfigError as e:  # offline, or past the model's positions: that reason
        return f"{said}; at that length: {e}"
    return f"{said}; the plan for it: {_plan_words(then)}, against {_plan_words(now)} now."


def _plan_words(prediction: dict) -> str:
    time = prediction.get("step_time")
    step = f", {format_seconds(StepTime(**time).seconds)} a step" if time else ""
    verdict = "" if prediction["fits"] else " (does NOT fit)"
    return f"{format_bytes(prediction['peak_mem_bytes'])} per process{verdict}{step}"
