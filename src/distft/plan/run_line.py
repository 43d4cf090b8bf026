"""The `run:` line: the `distft train` command that runs what the plan estimated.

Only strategies in the runtime's registry get one (`estimate.runnable`). The command carries every
setting the estimate assumed, because `distft train`'s defaults (fp32, micro-batch 4, 768 tokens)
are not the plan's: the model dtype, the micro-batch and the global batch it implies, the sequence
length, activation checkpointing, the attention kernel, the LoRA rank, the mesh degrees of the 2-D
strategies, HSDP's shard degree, fsdp+ep's expert groups, the pipeline's schedule and
micro-batches, and the steps the plan timed (`--steps`, or `--tokens` x `--epochs` over the layout's
tokens per step). Then what the estimate did not need but a run does: the learning rate for this
base and method (`distft.parallel.derive.default_lr`) and `--data`: the bundled sample for the
small CPU presets, a placeholder to replace for a real model (a preset mirroring a released model
is named by its hub id, whose pretrained weights are what one finetunes). `run_overrides` returns
them as the `section.key=value` overrides `distft.config.load_config` reads, so a test can parse
the line back into a config and compare.
"""

from __future__ import annotations

from distft.layout import SPECS
from distft.model import PRESETS
from distft.parallel.derive import default_lr
from distft.plan.estimate import Request, runnable
from distft.plan.inputs import Parallelism


def run_overrides(req: Request, method: str, ckpt: str, par: Parallelism) -> dict[str, str]:
    """`section.key` -> value for every setting the estimate of `par` assumed."""
    t = req.training
    out = {
        "model.dtype": t.precision.dtype,
        "model.attn_implementation": t.attention,
        "model.activation_checkpointing": ckpt,
        "data.max_length": str(t.seq_len),
        "train.micro_batch_size": str(t.micro_batch),
        "train.global_batch_size": str(t.micro_batch * par.microbatches * par.dp),
    }
    if t.mlp_tiles > 1:
        out["model.mlp_tiles"] = str(t.mlp_tiles)
    if t.rope_scaling != "none":
        out["model.rope_scaling"] = t.rope_scaling
        out["model.rope_factor"] = f"{t.rope_factor:g}"
    if method != "full":
        out["lora.rank"] = str(t.lora_rank)
        if t.dora:
            out["lora.variant"] = "dora"
    elif t.precision.dtype == "bfloat16":
        # fp32 masters (counted as such, or as mixed precision's) where they run
        masters = (t.fp32_masters or t.precision.master) and SPECS[par.name].runs("fp32_masters")
        out["train.master_weights"] = "fp32" if masters else "model"
    out |= par.dims.to_overrides(SPECS[par.name])  # the mesh, shard groups, expert groups
    if par.shard_experts:
        out["parallel.shard_experts"] = "true"
    if par.cp > 1 and par.cp_method != "allgather":  # the ring the estimate counted; allgather is the default
        out["parallel.cp_method"] = par.cp_method
    if par.pp > 1:
        out["parallel.schedule"] = par.schedule
        out["parallel.microbatches"] = str(par.microbatches)
    # The run the plan timed: --steps, or --tokens x --epochs at this layout's tokens per step.
    if steps := req.run.steps_for(t.micro_batch * t.seq_len * par.microbatches * par.dp):
        out["train.max_steps"] = str(steps)
    return out


def run_command(
    req: Request, strategy: str | None, method: str, ckpt: str, par: Parallelism | None
) -> str | None:
    """`distft train ...` for a runnable recommendation; None for one distft cannot run."""
    if strategy is None or par is None or not runnable(strategy, method):
        return None
    preset = PRESETS.get(req.model.name)
    model = (preset.hub_id or req.model.name) if preset else req.model.name
    # the bundled meetings suit the CPU presets only
    data = "sample" if model in PRESETS else DATA_PLACEHOLDER
    parts = ["distft train", f"--model {model}", f"--method {method}", f"--strategy {strategy}"]
    if SPECS[strategy].distributed:
        parts.append(f"--nproc {req.gpus_per_node}")
        if req.nodes > 1:
            parts.append(f"--nnodes {req.nodes}")
    parts += [f"{key}={value}" for key, value in run_overrides(req, method, ckpt, par).items()]
    parts += [f"optim.lr={default_lr(model, method)[0]:g}", f"--data {data}"]
    return " ".join(parts)


DATA_PLACEHOLDER = "YOUR_DATA.jsonl"  # a run: line's --data for a real model, to be replaced
