"""`distft bench --experts`: the experts' matmul of a mixture of experts, each implementation timed.

`model.experts_implementation` picks how transformers runs an MoE layer's experts
(`distft.model.experts`): eager (a Python loop over the experts hit), grouped_mm (one grouped
matmul over the rows sorted by expert), batched_mm (one batched matmul over a copy of each row's
expert weights) or grouped_lora (distft's grouped path: LoRA's factors applied to the rows, rows
moved by gathers, SiLU fused; the default).
They compute the same sums in a different order, so the bench times them on the
same model, weights and batch, and checks that their losses agree.

Per method (LoRA, full finetuning) the model is built once, through distft's own functions as a
run builds it; then rounds, the first `warmup` not counted and the median of the rest reported,
each implementation after the other within a round (eager, batched_mm, grouped_mm, grouped_lora)
so that a slow spell of a shared machine falls on each one alike. Two figures each:

- the step: `LossLM` forward and backward over a micro-batch of random tokens, what a training
  step computes before the optimizer. On a small-width model most of it is the embedding and the
  output head over a 151,936-token vocabulary, which no experts implementation changes;
- the experts alone: each layer's experts module (with its LoRA wrappers) forward and backward on
  exactly the rows, routing and weights the step's forward gave it, and a fixed gradient from
  above; the rows and the routing weights carry gradient, as in the step. This is what the
  implementation changes, and what the target compares. They take milliseconds where the step
  takes a second, so each round times them `experts_repeats` times, the implementations taking
  turns at every repeat.

Python's garbage collector runs before each timed call and is paused during it
(`collector_paused`), as `timeit` does: a collection of this process's objects (0.2 s, unless the
model and libraries are frozen out of it first, as here) would otherwise fall on whichever call
comes due, longer than the experts' forward and backward.

Target (docs/moe.md, "Grouped expert matmul"): the default's (`auto`, grouped_lora) experts at
least `TARGET` times as fast as eager's, the loop transformers' experts class is written as. It is reported, never
asserted in a test; the command fails only when the implementations' losses disagree.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from distft.bench.harness import environment
from distft.config import load_config
from distft.distributed import pick_device
from distft.errors import ConfigError
from distft.io.files import atomic_write_text
from distft.model import LossLM, apply_method, causal_lm, load_base_model
from distft.model.experts import AUTO, experts_modules, implementations_in_effect
from distft.text import plural

IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm", "grouped_lora")  # eager first: speed-ups over it
TARGET = 2.0  # the default's (`auto`: grouped_lora) experts over eager's
AGREEMENT = 1e-5  # the largest relative difference of a step's loss from eager's


@dataclass
class ExpertsSettings:
    model: str = "qwen3-moe-micro"
    methods: list[str] = field(default_factory=lambda: ["lora", "full"])
    micro_batch_size: int = 4
    seq_len: int = 512
    steps: int = 5  # measured rounds (the median is reported)
    warmup: int = 2  # rounds run first and not counted
    experts_repeats: int = 10  # the experts alone timed this many times a round, interleaved
    seed: int = 0  # the batch's random tokens
    overrides: list[str] = field(default_factory=list)


def synthetic_batch(settings: ExpertsSettings, device: torch.device) -> dict[str, torch.Tensor]:
    """Random token ids, every position labelled with the next one (the last with none)."""
    g = torch.Generator().manual_seed(settings.seed)
    ids = torch.randint(0, 1000, (settings.micro_batch_size, settings.seq_len), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], dim=1)
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def experts_calls(lm: nn.Module, model: LossLM, batch: dict) -> list[tuple[nn.Module, tuple]]:
    """Each MoE layer's experts module (the outermost: peft's wrappers included) and the arguments
    the step's forward gave it (hidden rows, top-k expert ids, top-k weights)."""
    layers = [layer.mlp.experts for layer in causal_lm(lm).model.layers if hasattr(layer.mlp, "experts")]
    caught: list[tuple] = []
    hooks = [m.register_forward_pre_hook(lambda _, args: caught.append(args)) for m in layers]
    with torch.no_grad():
        model(**batch)
    for hook in hooks:
        hook.remove()
    return [(m, tuple(a.detach() for a in args)) for m, args in zip(layers, caught, strict=True)]


def _now(device: torch.device) -> float:
    if device.type == "cuda":  # kernels run asynchronously: the clock waits for them
        torch.cuda.synchronize(device)
    return time.perf_counter()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector run first, then paused for the timed call, as `timeit`
    times: a collection otherwise falls on whichever call allocates when one comes due, and the
    cycles it frees (peft's registered parametrizations hold merged stacks) are memory the next
    call would find taken. Cheap here: the model and the libraries are frozen out of it."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def use_implementation(lm: nn.Module, name: str) -> None:
    """Every layer's experts set to run `name`, checked where they read it."""
    causal_lm(lm).set_experts_implementation(name)
    if implementations_in_effect(lm) != {name}:
        raise RuntimeError(f"experts implementation {name} did not reach every layer")


def time_step(model: LossLM, batch: dict, device: torch.device) -> tuple[float, float]:
    """Seconds for one forward + backward, and its loss."""
    model.zero_grad(set_to_none=True)
    start = _now(device)
    loss = model(**batch)
    loss.backward()
    return _now(device) - start, loss.item()


def time_experts(
    calls: list[tuple[nn.Module, tuple]], grads: list[torch.Tensor], device: torch.device
) -> float:
    """Seconds for every layer's experts, forward and backward, on the rows the step routed."""
    start = _now(device)
    for (module, (hidden, top_k_index, top_k_weights)), grad in zip(calls, grads, strict=True):
        # as in a step, the hidden states and the routing weights (the router's output) carry gradient
        rows, weights = hidden.clone().requires_grad_(True), top_k_weights.clone().requires_grad_(True)
        module(rows, top_k_index, weights).backward(grad)
    return _now(device) - start


def measure_method(settings: ExpertsSettings, method: str, device: torch.device) -> dict:
    """One method: its model built once, every implementation timed in interleaved rounds."""
    cfg = load_config(None, [f"model.name={settings.model}", f"train.method={method}", *settings.overrides])
    torch.manual_seed(cfg.model.seed)  # peft's lora_A, as a run seeds it
    lm = apply_method(load_base_model(cfg.model, device), cfg)
    if not experts_modules(lm):
        raise ConfigError(
            f"--experts times a mixture of experts' layers, and {settings.model} has none (a dense model): "
            "use --model qwen3-moe-micro or a Qwen3-MoE checkpoint."
        )
    model, batch = LossLM(lm), synthetic_batch(settings, device)
    calls = experts_calls(lm, model, batch)
    g = torch.Generator().manual_seed(settings.seed + 1)
    grads = [torch.randn(args[0].shape, generator=g).to(device, args[0].dtype) for _, args in calls]
    times = {name: {"step_s": [], "experts_s": []} for name in IMPLEMENTATIONS}
    losses: dict[str, float] = {}
    gc.collect()
    gc.freeze()  # what exists now (the model, the libraries) is never walked by a collection again
    for round_ in range(settings.warmup + settings.steps):
        for name in IMPLEMENTATIONS:
            use_implementation(lm, name)
            with collector_paused():
                step_s, losses[name] = time_step(model, batch, device)
            if round_ >= settings.warmup:
                times[name]["step_s"].append(step_s)
        # The experts take milliseconds where a step takes a second: timed several times a round,
        # each implementation after the other, so that a slow spell falls on each one alike.
        for _ in range(settings.experts_repeats):
            for name in IMPLEMENTATIONS:
                use_implementation(lm, name)
                with collector_paused():
                    experts_s = time_experts(calls, grads, device)
                if round_ >= settings.warmup:
                    times[name]["experts_s"].append(experts_s)
    gc.unfreeze()  # the model is garbage once this method is measured
    tokens = settings.micro_batch_size * settings.seq_len
    rows = [_row(name, times[name], losses[name], tokens) for name in IMPLEMENTATIONS]
    for row in rows:  # speed-ups over eager, the first row
        row["step_speedup"] = rows[0]["step_ms"] / row["step_ms"]
        row["experts_speedup"] = rows[0]["experts_ms"] / row["experts_ms"]
        row["loss_rel_diff"] = abs(row["loss"] - rows[0]["loss"]) / abs(rows[0]["loss"])
    return {"method": method, "layers": len(calls), "experts_modules": len(experts_modules(lm)), "rows": rows}


def _row(name: str, times: dict[str, list[float]], loss: float, tokens: int) -> dict:
    step, experts = statistics.median(times["step_s"]), statistics.median(times["experts_s"])
    return {
        "implementation": name,
        "step_ms": step * 1e3,
        "tokens_per_s": tokens / step,
        "experts_ms": experts * 1e3,
        "experts_tokens_per_s": tokens / experts,
        "loss": loss,
        "step_s": times["step_s"],
        "experts_s": times["experts_s"],
    }


def run_experts_bench(settings: ExpertsSettings) -> dict:
    """Every method measured on the CUDA device if there is one, else the CPU; the agreement of
    the losses and the target checked on the figures."""
    device = pick_device()  # on the CPU, with malloc set as a CPU run computes
    results = [measure_method(settings, method, device) for method in settings.methods]
    grouped = {r["method"]: _find(r, AUTO)["experts_speedup"] for r in results}
    return {
        "settings": asdict(settings),
        "environment": {
            **environment(),
            "threads": torch.get_num_threads(),
            "load_1min": os.getloadavg()[0],  # runnable processes after the runs: others' work shows
        },
        "results": results,
        "agrees": all(row["loss_rel_diff"] <= AGREEMENT for r in results for row in r["rows"]),
        "target": {
            "speedup": TARGET,
            "implementation": AUTO,
            "speedups": grouped,
            "met": min(grouped.values()) >= TARGET,
        },
    }


def _find(result: dict, name: str) -> dict:
    return next(row for row in result["rows"] if row["implementation"] == name)


def print_table(summary: dict, console: Console | None = None) -> None:
    """The figures as a rich table: one row per method and implementation."""
    table = Table(title="Experts implementations: forward + backward (median)")
    for column in ("method", "implementation", "ms per step", "tokens/s", "speed-up",
                   "experts ms", "experts tokens/s", "experts speed-up", "loss vs eager"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("method", "implementation") else "right")
    for result in summary["results"]:
        for row in result["rows"]:
            table.add_row(result["method"], row["implementation"], *_cells(row))
    console = console or Console()
    if not console.is_terminal:  # a log or a pipe: wide enough for every column, not rich's 80
        console.width = 130
    console.print(table)


def _cells(row: dict) -> list[str]:
    return [
        f"{row['step_ms']:.1f}",
        f"{row['tokens_per_s']:,.0f}",
        f"{row['step_speedup']:.2f}x",
        f"{row['experts_ms']:.1f}",
        f"{row['experts_tokens_per_s']:,.0f}",
        f"{row['experts_speedup']:.2f}x",
        f"{row['loss_rel_diff']:.1e}",
    ]


def render(summary: dict) -> str:
    """The markdown section: the settings and machine, the table, the agreement and the target."""
    s, env, target = summary["settings"], summary["environment"], summary["target"]
    where = (
        f"{plural(env['cpu_count'], 'CPU core')}, {plural(env['threads'], 'torch thread')}"
        if env["device"] == "cpu"
        else env["device"]
    )
    lines = [
        "## Grouped expert matmul",
        "",
        f"`{s['model']}`, a micro-batch of {s['micro_batch_size']} x {s['seq_len']} random tokens; {where}, "
        f"torch {env['torch']}, transformers {env['transformers']}, peft {env['peft']}; load average "
        f"{env['load_1min']:.1f} after the runs. Medians of {plural(s['steps'], 'round')}, interleaved, after "
        f"{s['warmup']} not counted. Step: `LossLM` forward + backward; experts: every layer's experts "
        f"module forward + backward on the rows the step routed, {s['experts_repeats']} times a round.",
        "",
        "| method | implementation | ms per step | tokens/s | speed-up | experts ms | experts tokens/s "
        "| experts speed-up | loss vs eager |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for result in summary["results"]:
        for row in result["rows"]:
            lines.append(
                f"| {result['method']} | {row['implementation']} | " + " | ".join(_cells(row)) + " |"
            )
    measured = ", ".join(f"{method} {x:.2f}x" for method, x in target["speedups"].items())
    agrees = "yes" if summary["agrees"] else "no"
    lines += [
        "",
        f"Losses agree with eager's within {AGREEMENT:.0e} (relative): **{agrees}**.",
        f"Target: {target['implementation']}'s experts (the default) at least {target['speedup']:.0f}x eager's: {measured}, "
        f"**{'met' if target['met'] else 'not met'}**.",
    ]
    return "\n".join(lines) + "\n"


def write_experts_report(summary: dict, out: Path) -> Path:
    """`DIR/experts.json`, the whole record, and `DIR/experts.md`, its markdown section."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "experts.json", json.dumps(summary, indent=1))
    path = out / "experts.md"
    atomic_write_text(path, render(summary))
    return path
