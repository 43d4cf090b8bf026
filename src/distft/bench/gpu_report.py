"""`distft bench --gpu`'s report.md (the measured runs, the ratios, the targets) and its run record,
RECORD.md (when, the command, the versions, the device, then the same figures)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from distft.bench.gpu_scaling import scaling_section
from distft.io.files import atomic_write_text

GIB = 2**30


def _num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _verdict(t: dict) -> str:
    if t["met"] is None:
        return "not measured"
    verdict = "met" if t["met"] else "**not met**"
    return verdict if t["applies"] else f"{verdict} (not the target's setting: indicative only)"


def _value(t: dict) -> str:
    v, unit = t["value"], t["unit"]
    if v is None:
        return "n/a"
    return {"%": f"{v:.1%}", "tokens/s": f"{v:,.0f}", "x": f"{v:.2f}x", "s": f"{v:.2f} s"}.get(
        unit, f"{v:.1e}"
    )


def parity_section(parity: dict | None) -> list[str]:
    """Both loss curves step by step, their largest relative difference and the verdict."""
    lines = ["", "## Loss parity with the plain loop", ""]
    if parity is None:
        return [*lines, "Not measured: the plain loop or distft's parity run did not finish."]
    verdict = "within" if parity["within"] else "**outside**"
    lines += [
        f"distft LoRA trained at the plain loop's settings (lr {parity['lr']:g}, constant, no warm-up, no "
        "weight decay, clip 1.0), from the same weights on the same global batches (`distft.bench.parity`). "
        f"Largest relative difference {parity['max_relative_difference']:.2e}: {verdict} the tolerance "
        f"{parity['tolerance']:g}.",
        "",
        "| step | distft | plain loop | relative difference |",
        "|---|---|---|---|",
    ]
    for step, (a, b) in enumerate(zip(parity["distft"], parity["plain"], strict=True), 1):
        lines.append(f"| {step} | {a:.5f} | {b:.5f} | {abs(a - b) / abs(b):.1e} |")
    return lines


def render(summary: dict) -> str:
    s, env = summary["settings"], summary["environment"]
    lines = [
        "# distft bench --gpu: LoRA, QLoRA and full finetuning on one device, against the plain loop",
        "",
        f"Model `{s['model']}`, {summary['dtype']}, sequences of {s['seq_len']} tokens (every row full), "
        f"micro-batch {s['micro_batch_size']}, global batch {s['global_batch_size']}, LoRA r=16 on every "
        f"projection, {s['warmup']} unmeasured + {s['steps']} measured steps, seed {s['seed']}. Device "
        f"{env['device']}; torch {env['torch']}, transformers {env['transformers']}, peft {env['peft']}.",
        "",
        "## Measured",
        "",
        "Medians over the measured steps. MFU: model FLOPs (`distft.measure.flops`, the same count for "
        "distft and the plain loop) / step time / the GPU's dense bf16 peak; n/a off a known GPU. Start-up: "
        "process start to step 1; first step: step 1 itself (torch.compile runs there). Compiled graphs "
        "and attention: the graphs torch.compile built and the attention kernel that ran, from the run's "
        "metrics.jsonl (n/a where it does not record them, as the plain loop). Every distft run compiles "
        "into the suite's own cache, emptied first: the lora row's step 1 compiles cold, the lora-parity "
        "row (the same graph, at the plain loop's learning rate) finds it warm.",
        "",
        "| run | tokens/s | step time (s) | MFU | peak memory (GiB) | start-up (s) | first step (s) "
        "| compiled graphs | attention |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary["rows"].values():
        lines.append(
            f"| {row['run']} | {row['tokens_per_s']:,.0f} | {row['step_time_s']:.3f} | "
            f"{_num(row['mfu'] and 100 * row['mfu'], '.1f')}{'%' if row['mfu'] else ''} | "
            f"{row['peak_mem_bytes'] / GIB:.2f} | {_num(row['startup_s'], '.1f')} | {_num(row['first_step_s'], '.2f')} | "
            f"{_num(row.get('compiled_graphs'), 'd')} | {row.get('attention') or 'n/a'} |"
        )
    lines += scaling_section(summary.get("scaling") or {})
    r = summary["ratios"]
    lines += [
        "",
        "## Ratios",
        "",
        "| ratio | value |",
        "|---|---|",
        f"| QLoRA / LoRA, tokens/s | {_num(r['qlora_vs_lora_tokens_per_s'], '.2f')} |",
        f"| FP8-base LoRA / LoRA, tokens/s | {_num(r.get('fp8_vs_lora_tokens_per_s'), '.2f')} |",
        f"| distft LoRA / plain loop, tokens/s | {_num(r['distft_vs_plain_tokens_per_s'], '.2f')} |",
        f"| distft LoRA / plain loop, MFU | {_num(r['distft_vs_plain_mfu'], '.2f')} |",
        f"| distft LoRA / plain loop, peak memory | {_num(r['distft_vs_plain_peak_memory'], '.2f')} |",
        f"| distft LoRA / plain loop, start-up | {_num(r['distft_vs_plain_startup'], '.2f')} |",
        *parity_section(summary.get("parity")),
        "",
        "## Targets",
        "",
        "The absolute figures are for Qwen3-4B at these shapes on one H100 or H200 (NeMo AutoModel's at "
        "its own shape), the ratios and the loss parity for any device; elsewhere the verdict is indicative only.",
        "",
        "| target | measured | verdict |",
        "|---|---|---|",
    ]
    lines += [f"| {t['target']} | {_value(t)} | {_verdict(t)} |" for t in summary["targets"]]
    if summary["failures"]:
        lines += ["", "## Failed runs", ""]
        lines += [f"- {name}: {why}" for name, why in summary["failures"].items()]
    return "\n".join(lines) + "\n"


def write_gpu_report(summary: dict, out: Path) -> Path:
    path = out / "report.md"
    atomic_write_text(path, render(summary))
    return path


def _when(summary: dict) -> str:
    start, end = (datetime.fromisoformat(summary[k]) for k in ("started_utc", "finished_utc"))
    minutes, seconds = divmod(round((end - start).total_seconds()), 60)
    return f"{start:%Y-%m-%d %H:%M:%S} to {end:%H:%M:%S} UTC ({minutes} min {seconds} s)"


def render_record(summary: dict, command: str, spelled_out: str) -> str:
    """RECORD.md: what a committed report needs beside its figures (docs/reports/README.md), then
    the figures themselves, report.md's sections one heading level down."""
    env = summary["environment"]
    memory = f"{env['device_memory_bytes'] / GIB:.1f} GiB" + (" (host RAM)" if env["device"] == "cpu" else "")
    lines = [
        f"# Run record: `distft bench --gpu` on {env['device']}",
        "",
        f"**Date.** {_when(summary)}.",
        "",
        "**Command** (the exact one):",
        "",
        "```bash",
        command,
        "```",
        "",
        f"Every setting spelled out: `{spelled_out}`.",
        "",
        "| | |",
        "|---|---|",
        f"| device | {env['device']}, {memory} |",
        f"| Python | {env['python']} |",
        f"| torch | {env['torch']} |",
        f"| CUDA | {env.get('cuda') or 'n/a'} |",
        f"| transformers | {env['transformers']} |",
        f"| peft | {env['peft']} |",
        f"| torchao | {env.get('torchao') or 'not installed'} |",
        f"| platform | {env['platform']} |",
        "",
    ]
    report = render(summary).splitlines()
    lines += ["#" + line if line.startswith("#") else line for line in report]
    return "\n".join(lines) + "\n"


def write_record(summary: dict, folder: Path, command: str, spelled_out: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "RECORD.md"
    atomic_write_text(path, render_record(summary, command, spelled_out))
    return path
