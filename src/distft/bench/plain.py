"""The plain transformers + peft LoRA loop, as a user would write it: the GPU suite's baseline.

`python -m distft.bench.plain --model qwen3-4b --seq-len 2048 --data long.jsonl --out plain.json`

`AutoModelForCausalLM` built on the device in the given dtype, peft LoRA on every projection (a
mixture of experts' expert stacks by parameter; no router loss, which transformers adds only on request),
AdamW (fused on CUDA, as the reference plain loop; no weight decay, as distft's default),
`model(..., num_items_in_batch=...).loss` over right-padded rows (logits for every position; the
loss of a global batch is its summed token losses over its labelled tokens, as transformers' Trainer
and distft count it), no compile, no packing. It trains on the very rows distft's runs train on
(distft's tokenization of the same file and the same seeded global batches), from the weights
distft starts from (the preset drawn under the seed, then LoRA's initialisation under it again,
as `distft train` does), so at one learning rate the two loss curves are comparable step by step. Writes one JSON object: step times, tokens/s, MFU in
distft's convention (`distft.measure.flops`: the same model FLOPs, so the ratio is a ratio of
speeds), peak memory and start-up (process start to step 1).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from distft.config import PROJECTION_NAMES, load_config
from distft.data import (
    IGNORE,
    ChatFormatter,
    Example,
    collate,
    count_label_tokens,
    global_batch_indices,
    load_rows,
    tokenize_rows,
)
from distft.data.tokenizer import load_tokenizer
from distft.io.files import atomic_write_text
from distft.measure.flops import ModelFlops, peak_flops
from distft.model import peft_quietly
from distft.model.build import EXPERT_PARAMETERS, lora_targets
from distft.model.families import FAMILIES
from distft.model.presets import DTYPES, PRESETS, tokenizer_ranks
from distft.train.metrics import startup_seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m distft.bench.plain", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="micro", help="a distft preset or a transformers model directory")
    p.add_argument("--data", default="sample", help="data.source: the rows distft trains on")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=4, help="measured steps")
    p.add_argument("--warmup", type=int, default=2, help="steps before measuring")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4, help="constant learning rate (no warm-up, no decay)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="where to write the JSON result")
    p.add_argument("--set", action="append", default=[], help="data.KEY=VALUE: how distft reads the rows")
    return p.parse_args(argv)


def build_model(name: str, dtype: torch.dtype, device: torch.device, seed: int, rank: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if name in PRESETS:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(PRESETS[name].to_config(), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, device_map=device)
    model.config.use_cache = False
    torch.manual_seed(seed)  # LoRA's initialisation: distft seeds it the same way
    # A mixture of experts' MLP is two fused stacks, not Linear layers: peft reaches them by
    # parameter (`target_parameters`), one adapter per expert, as distft adapts them.
    family = FAMILIES.get(model.config.model_type)
    moe = family is not None and family.moe
    experts = (
        sorted({EXPERT_PARAMETERS[n] for n in PROJECTION_NAMES if n in EXPERT_PARAMETERS}) if moe else None
    )
    targets = lora_targets(list(PROJECTION_NAMES), moe)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, target_parameters=experts)
    with peft_quietly():  # peft's own deprecation warning
        return get_peft_model(model, config)


def distft_rows(model: str, overrides: list[str], seed: int) -> tuple[list[Example], int]:
    """(the training rows distft tokenizes for `model` under `overrides`, the pad id)."""
    cfg = load_config(None, [f"model.name={model}", f"train.seed={seed}", *overrides])
    tokenizer = load_tokenizer(None if model in PRESETS else model, ranks=tokenizer_ranks(model))
    formatter = ChatFormatter(tokenizer, cfg.data)
    return tokenize_rows(load_rows(cfg.data, seed=seed)["train"], formatter).examples, tokenizer.pad_token_id


def plain_loss(
    model: torch.nn.Module, micro: list[Example], pad_id: int, device, labelled: int
) -> torch.Tensor:
    """One micro-batch as a user would run it: right-padded rows, `model(...).loss` over every
    position, summed and divided by the global batch's `labelled` tokens (transformers'
    `num_items_in_batch`). transformers shifts the labels itself, so it is given them unshifted."""
    batch = {k: v.to(device) for k, v in collate(micro, pad_id).items()}
    labels = torch.cat([torch.full_like(batch["labels"][:, :1], IGNORE), batch["labels"][:, :-1]], 1)
    return model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        labels=labels,
        num_items_in_batch=labelled,
    ).loss


@dataclass
class PlainSteps:
    """What `train_plain` saw, one entry per step (warm-up included)."""

    times: list[float] = field(default_factory=list)  # seconds, host-synced
    losses: list[float] = field(default_factory=list)  # mean over the micro-batches
    batches: list[list[Example]] = field(default_factory=list)  # the global batch it trained on


def train_plain(
    model: torch.nn.Module,
    examples: list[Example],
    pad_id: int,
    device: torch.device,
    steps: int,
    global_batch: int,
    micro_batch: int,
    seed: int,
    lr: float = 1e-4,
) -> PlainSteps:
    """`steps` optimizer steps of the plain loop over distft's seeded global batches of `examples`."""
    # ---- the plain loop starts here ------------------------------------------------------
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=device.type == "cuda" or None)
    accumulation = global_batch // micro_batch
    out = PlainSteps()
    for step in range(steps):
        rows = [examples[i] for i in global_batch_indices(step, len(examples), global_batch, seed)]
        labelled = count_label_tokens(rows)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, total = time.perf_counter(), 0.0
        for i in range(accumulation):
            micro = rows[i * micro_batch : (i + 1) * micro_batch]
            loss = plain_loss(model, micro, pad_id, device, labelled)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.losses.append(float(total))  # the host sync; the global batch's mean token loss
        out.times.append(time.perf_counter() - start)
        out.batches.append(rows)
    # ---- and ends here -------------------------------------------------------------------
    return out


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(a: argparse.Namespace) -> dict:
    data = [f"data.source={a.data}", f"data.max_length={a.seq_len}", *a.set]
    examples, pad_id = distft_rows(a.model, data, a.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(a.model, DTYPES[a.dtype], device, a.seed, a.lora_rank)
    flops = ModelFlops.from_model(model)
    startup = startup_seconds()  # distft's clock: from this process's start, imports included
    steps = train_plain(
        model, examples, pad_id, device, a.warmup + a.steps, a.global_batch, a.micro_batch, a.seed, a.lr
    )
    times = steps.times
    tokens = [sum(len(e.input_ids) for e in rows) for rows in steps.batches]
    step_flops = [flops.step(rows) for rows in steps.batches]

    peak, _ = peak_flops(device)
    measured = range(a.warmup, a.warmup + a.steps)
    return {
        "what": "plain transformers + peft LoRA loop",
        "settings": vars(a),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "step_time_s": statistics.median(times[i] for i in measured),
        "tokens_per_s": statistics.median(tokens[i] / times[i] for i in measured),
        "mfu": statistics.median(step_flops[i] / times[i] / peak for i in measured) if peak else None,
        "peak_mem_bytes": peak_memory(device),
        "startup_s": startup,
        "first_step_s": times[0],
        "losses": steps.losses,
        "times": times,
    }


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    atomic_write_text(Path(a.out), json.dumps(run(a), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
