"""The same single-device LoRA step written as the plain torch + peft loop a user would write.

Timed in the same benchmark run, it shows what distft's own machinery costs (or saves): the
ratio of distft's single-strategy step time to this loop's. The loop is `distft.bench.plain`'s
(`train_plain`), deliberately plain: `model(**batch).loss`, which computes logits for every
position, where distft's loss head runs lm_head on the summary tokens only.
"""

from __future__ import annotations

import statistics

import torch

from distft.bench.plain import build_model, distft_rows, train_plain
from distft.config import LoraConfig, ModelConfig, OptimConfig
from distft.data import IGNORE
from distft.model import DTYPES


def time_plain_loop(settings) -> dict:  # settings: BenchSettings
    examples, pad_id = distft_rows(settings.model, [f"data.max_length={settings.seq_len}"], settings.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[ModelConfig().dtype]
    model = build_model(settings.model, dtype, device, settings.seed, LoraConfig().rank)
    steps = train_plain(
        model, examples, pad_id, device, settings.warmup + settings.steps,
        settings.global_batch_size, settings.micro_batch_size, settings.seed, OptimConfig().lr,
    )  # fmt: skip
    measured = steps.times[settings.warmup :]
    return {
        "step_time_s": {"median": statistics.median(measured), "min": min(measured), "max": max(measured)},
        # What the plan's activation model needs to compare with the data actually trained on.
        "label_tokens_per_sequence": statistics.median(sum(t != IGNORE for t in e.labels) for e in examples),
        "tokens_per_sequence": statistics.median(len(e.input_ids) for e in examples),
    }
