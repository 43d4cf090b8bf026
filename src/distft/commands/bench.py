"""`distft bench`'s flags and their defaults (`distft.bench` and its sweeps read them from here).
The command is `distft.bench`'s."""

from __future__ import annotations

import argparse

DEFAULT_STRATEGIES = (
    "single,ddp,fsdp,zero2,tp,tp-sp,pp"  # the default comparison: one of each mechanism, on 2 processes
)
PP_SCHEDULES = "gpipe,1f1b,interleaved-1f1b,zero-bubble,zbv"
DEFAULT_OUT = "runs/bench"
DEFAULT_SPLITS = "balanced,even"  # --pp-splits (`bench.pp_sweep`)
DEFAULT_LEVERS = "none,full,offload"  # --seq-levers (`bench.seq_sweep`)
# bench's named experiments (`distft bench --study NAME`, run by `distft.bench.study`): each
# configuration's label -> (strategy, switches); the first multi-process one is the correct one.
STUDIES: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {
    "ddp-misconfig": {
        "single": ("single", ()),
        "ddp (correct)": ("ddp", ()),
        "find_unused_parameters": ("ddp", ("parallel.ddp_find_unused_parameters=true",)),
        "broadcast_buffers": ("ddp", ("parallel.ddp_broadcast_buffers=true",)),
        "no no_sync": ("ddp", ("parallel.ddp_no_sync=false",)),
        "bucket 0.001 MB": ("ddp", ("parallel.ddp_bucket_mb=0.001",)),
    },
    "fsdp-wrap": {
        "single": ("single", ()),
        "fsdp, per layer (correct)": ("fsdp", ()),
        "fsdp, whole model": ("fsdp", ("parallel.fsdp_wrap=model",)),
        "fsdp, no prefetch": ("fsdp", ("parallel.fsdp_prefetch=0",)),
        "zero2, per layer": ("zero2", ()),
        "zero2, whole model": ("zero2", ("parallel.fsdp_wrap=model",)),
    },
}


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run strategies side by side and write a report with plots",
        description="Run each strategy with the same model, data, global batch, sequence length and seed; "
        "collect step time, tokens/s, peak memory per rank, bytes per collective (measured and analytic) "
        "and loss curves; write DIR/results.json, DIR/report.md and PNG plots.",
    )
    p.add_argument(
        "--strategies",
        help=f"comma-separated (default {DEFAULT_STRATEGIES}; --seq-sweep: single, and cp when --nproc > 1)",
    )
    p.add_argument("--nproc", type=int, default=2, help="processes for the multi-process strategies")
    p.add_argument(
        "--model", help="preset, local directory or hub id (default tiny; --gpu: qwen3-4b; --startup: micro)"
    )
    p.add_argument("--steps", type=int, help="measured optimizer steps per run (default 10; --gpu: 6)")
    p.add_argument("--warmup", type=int, help="steps run before measuring (default 3; --gpu: 2)")
    p.add_argument(
        "--global-batch", type=int, help="sequences per optimizer step (default 8; --seq-sweep: 1)"
    )
    p.add_argument(
        "--micro-batch", type=int, help="sequences per forward/backward on a rank (default 2; --seq-sweep: 1)"
    )
    p.add_argument("--seq-len", type=int, help="data.max_length (default 512; --gpu: 2048)")
    _add_gpu_arguments(p)
    _add_pp_sweep_arguments(p)
    p.add_argument(
        "--project",
        default="",
        metavar="PROFILES",
        help="project the measured compute and bytes onto hardware profiles, e.g. 2xrtx4090-pcie,8xh100-nvlink "
        "(N x a `distft plan` GPU, optionally -pcie/-nvlink/...), and say which strategy should win there",
    )
    p.add_argument(
        "--study",
        choices=list(STUDIES),
        help="run a correct configuration beside its misconfigurations (ddp-misconfig, fsdp-wrap) instead of "
        "--strategies; writes DIR/study.md and DIR/study_NAME.png",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per strategy (or --study configuration), interleaved; the report gives each one's median "
        "and min-max over the runs and names a winner only where the ranges do not overlap (default 1)",
    )
    _add_startup_arguments(p)
    _add_seq_sweep_arguments(p)
    _add_experts_arguments(p)
    p.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help="output directory (default runs/bench; --gpu: runs/bench-gpu; --startup: runs/bench-startup; "
        "--seq-sweep: runs/bench-seq; --experts: runs/bench-experts)",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: rewrite DIR/report.md, the plots and the projections from DIR/results.json "
        "(with this command's --project profiles)",
    )
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="passed to every `distft train`")


def _add_gpu_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gpu",
        action="store_true",
        help="the one-device suite instead: distft single LoRA, QLoRA and full finetuning and the plain "
        "transformers+peft loop at the blog series' shapes (qwen3-4b, seq 2048, micro-batch 2, global 8, bf16); "
        "tokens/s, MFU, peak memory, start-up, the ratios and the targets (docs/bench.md)",
    )
    p.add_argument(
        "--methods",
        help="--gpu: the distft methods to run, of lora, qlora, full, lora-fp8 (default all four on a GPU "
        "with float8 tensor cores, compute capability >= 8.9; else the first three); --experts: of lora, full "
        "(default both)",
    )
    p.add_argument(
        "--gpus",
        type=int,
        help="--gpu: also run LoRA under ddp and fsdp on this many devices (default every GPU of the "
        "machine when it has several; on the CPU, N gloo processes check the wiring)",
    )
    p.add_argument(
        "--record",
        metavar="DIR",
        help="--gpu: write the run record DIR/RECORD.md (date, command, versions, device, every figure); "
        "default on CUDA docs/reports/gpu/DEVICE, none on the CPU",
    )


def _add_pp_sweep_arguments(p: argparse.ArgumentParser) -> None:
    """`distft bench --pp-sweep`: pp per schedule, micro-batch count and cut (`bench.pp_sweep`)."""
    p.add_argument(
        "--pp-sweep",
        nargs="?",
        const=PP_SCHEDULES,
        default="",
        metavar="SCHEDULES",
        help=f"also run pp for each schedule (default with no value: {PP_SCHEDULES}), each --pp-microbatches "
        "and each --pp-splits: idle fraction vs micro-batches, measured against the cost model and theory, "
        "and a Gantt chart per schedule and split",
    )
    p.add_argument(
        "--pp-microbatches", default="4,8", help="micro-batch counts of the pipeline sweep (default 4,8)"
    )
    p.add_argument(
        "--pp-splits",
        default=DEFAULT_SPLITS,
        metavar="SPLITS",
        help=f"cuts of the layers the pipeline sweep runs (parallel.pp_split; default {DEFAULT_SPLITS}): "
        "balanced, even, or layers per stage joined by '-', e.g. 3-1",
    )


def _add_startup_arguments(p: argparse.ArgumentParser) -> None:
    """`distft bench --startup`: start-up time against the dataset's size (`bench.startup`)."""
    p.add_argument(
        "--startup",
        action="store_true",
        help="time from the command to step 1 against the dataset's size (--rows), token cache off, cold and "
        "warm, on --nproc ranks of ddp; writes DIR/startup.md and fails if a warm start-up exceeds the smallest "
        "size's by more than --startup-bound seconds (docs/data.md)",
    )
    p.add_argument(
        "--rows", default="1000,10000,100000", help="--startup: dataset sizes (default 1000,10000,100000)"
    )
    p.add_argument(
        "--startup-bound", type=float, default=5.0, help="--startup: the bound in seconds (default 5)"
    )


def _add_seq_sweep_arguments(p: argparse.ArgumentParser) -> None:
    """`distft bench --seq-sweep`: doubling sequence lengths per strategy and lever (`bench.seq_sweep`)."""
    p.add_argument(
        "--seq-sweep",
        action="store_true",
        help="instead of one length: each strategy x lever at doubling data.max_length from --seq-start to "
        "--seq-max or until a run runs out of memory; tokens/s, MFU, peak memory and activations (measured and "
        "planned) per length; writes DIR/report.md, DIR/results.json and DIR/seq_sweep.png",
    )
    p.add_argument("--seq-start", type=int, default=1024, help="--seq-sweep: the first length (default 1024)")
    p.add_argument(
        "--seq-max", type=int, default=0, help="--seq-sweep: the last length (default: the model's positions)"
    )
    p.add_argument(
        "--seq-levers",
        default=DEFAULT_LEVERS,
        help=f"--seq-sweep: model.activation_checkpointing levels, each optionally +tilesK for model.mlp_tiles=K "
        f"(default {DEFAULT_LEVERS}; offload is skipped on the CPU, where it is full)",
    )


def _add_experts_arguments(p: argparse.ArgumentParser) -> None:
    """`distft bench --experts`: an MoE's experts implementations side by side (`bench.experts`)."""
    p.add_argument(
        "--experts",
        action="store_true",
        help="instead of strategies: time forward + backward of an MoE (--model, default qwen3-moe-micro) under "
        "each model.experts_implementation (eager, batched_mm, grouped_mm, grouped_lora) on the same batch (--micro-batch, "
        "default 4, x --seq-len, default 512; --warmup 2, then the median of --steps 5), LoRA and full "
        "(--methods); writes DIR/experts.md and DIR/experts.json (docs/moe.md)",
    )
