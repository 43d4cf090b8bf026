"""The same single-device LoRA step written as the plain torch + peft loop a user would write.

Timed in the same benchmark run, it shows what distft's own machinery costs (or saves): the
ratio of distft's single-strategy step time to this loop's. The loop is deliberately plain:
`model(**batch).loss`, which computes logits for every position, where distft's loss head runs
lm_head on the summary tokens only.
"""

from __future__ import annotations

import statistics
import time

import torch
from peft import LoraConfig, get_peft_model

from distft.bench.plain import plain_loss
from distft.config import load_config
from distft.data import IGNORE, ChatFormatter, global_batch_indices, load_rows, tokenize_rows
from distft.data.tokenizer import qwen3_tokenizer
from distft.model import load_base_model, peft_quietly


def time_plain_loop(settings) -> dict:  # settings: BenchSettings
    cfg = load_config(None, [f"model.name={settings.model}", f"data.max_length={settings.seq_len}"])
    tokenizer = qwen3_tokenizer()
    examples = tokenize_rows(load_rows(cfg.data)["train"], ChatFormatter(tokenizer, cfg.data)).examples

    # ---- the plain loop starts here ------------------------------------------------------
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(settings.seed)
    with peft_quietly():  # peft's own deprecation warning
        model = get_peft_model(
            load_base_model(cfg.model),
            LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, target_modules=cfg.lora.target_modules),
        ).to(device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.optim.lr)
    accumulation = settings.global_batch_size // settings.micro_batch_size
    times = []
    for step in range(settings.warmup + settings.steps):
        rows = [examples[i] for i in global_batch_indices(step, len(examples), settings.global_batch_size, 0)]
        start = time.perf_counter()
        for i in range(accumulation):
            micro = rows[i * settings.micro_batch_size : (i + 1) * settings.micro_batch_size]
            loss = plain_loss(model, micro, tokenizer.pad_token_id, device)
            (loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    # ---- and ends here -------------------------------------------------------------------

    measured = times[settings.warmup :]
    return {
        "step_time_s": {"median": statistics.median(measured), "min": min(measured), "max": max(measured)},
        # What the plan's activation model needs to compare with the data actually trained on.
        "label_tokens_per_sequence": statistics.median(sum(t != IGNORE for t in e.labels) for e in examples),
        "tokens_per_sequence": statistics.median(len(e.input_ids) for e in examples),
    }
