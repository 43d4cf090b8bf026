"""`distft bench --gpu` on a machine of several GPUs: LoRA under ddp and fsdp on all of them.

One GPU's LoRA row is the baseline. On N GPUs each strategy runs the same model, rows and
sequence length, the global batch at least N micro-batches (`scaling_global_batch`: every rank
gets one), and the report gives per strategy tokens/s, MFU, peak memory, the scaling efficiency
(tokens/s on N GPUs / (N x tokens/s on one)) and every collective's bytes on rank 0 against
the plan's formula (`distft.measure.comm`'s convention, the figures `distft bench` compares for
every strategy). On the CPU `--gpus N` runs the same rows as N gloo processes: a check of the
wiring, not a speed.
"""

from __future__ import annotations

import torch

from distft.errors import ConfigError
from distft.text import plural

SCALING_STRATEGIES = ("ddp", "fsdp")


def default_gpus() -> int:
    """Every GPU of the machine; 1 (no scaling rows) on the CPU."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def check_gpus(gpus: int, cuda: bool) -> None:
    """`--gpus`: at least one, and no more than the machine has (on the CPU, processes: any)."""
    have = torch.cuda.device_count() if cuda and gpus > 1 else gpus
    if not 1 <= gpus <= have:
        raise ConfigError(f"--gpus {gpus}: this machine has {plural(have, 'GPU')}; pass 1 to {have}.")


def scaling_global_batch(global_batch: int, micro_batch: int, gpus: int) -> int:
    """The suite's global batch, raised to one micro-batch per GPU and rounded up to a multiple of
    that (every rank runs whole micro-batches)."""
    per_step = micro_batch * gpus
    return max(per_step, -(-global_batch // per_step) * per_step)


def scaling_row(result, strategy: str, gpus: int, one_gpu: dict | None) -> dict:
    """The report's figures of one multi-GPU run (`result`: the harness's StrategyResult)."""
    tokens = result.tokens_per_s["median"]
    single = one_gpu and one_gpu.get("tokens_per_s")
    return {
        "run": f"distft lora, {strategy} x {gpus}",
        "strategy": strategy,
        "gpus": gpus,
        "tokens_per_s": tokens,
        "step_time_s": result.step_time_s["median"],
        "mfu": result.extra.get("mfu"),
        "peak_mem_bytes": max(rank["peak_mem_bytes"] for rank in result.ranks),
        "scaling_efficiency": tokens / (gpus * single) if single else None,
        "comm_bytes": result.comm_bytes,
        "comm_bytes_expected": result.comm_bytes_expected,
        "losses": result.losses,
    }


def scaling_section(scaling: dict[str, dict]) -> list[str]:
    """The report's lines for the multi-GPU rows (none when the suite ran on one device)."""
    if not scaling:
        return []
    lines = [
        "",
        "## Several GPUs: LoRA under ddp and fsdp",
        "",
        "Scaling efficiency: tokens/s on N GPUs / (N x the one-GPU LoRA row's). Bytes: rank 0's per "
        "collective on step 1, measured / the plan's formula.",
        "",
        "| run | tokens/s | MFU | peak memory (GiB) | scaling efficiency | bytes measured / planned |",
        "|---|---|---|---|---|---|",
    ]
    for row in scaling.values():
        mfu = "n/a" if row["mfu"] is None else f"{row['mfu']:.1%}"
        efficiency = "n/a" if row["scaling_efficiency"] is None else f"{row['scaling_efficiency']:.0%}"
        expected = row["comm_bytes_expected"]
        bytes_ = ", ".join(
            f"{op} {n:,} / {expected[op]:,}" if op in expected else f"{op} {n:,} / not planned"
            for op, n in sorted(row["comm_bytes"].items())
        )
        lines.append(
            f"| {row['run']} | {row['tokens_per_s']:,.0f} | {mfu} | {row['peak_mem_bytes'] / 2**30:.2f} "
            f"| {efficiency} | {bytes_ or 'none'} |"
        )
    return lines
