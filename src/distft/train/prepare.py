"""Before launch, in the command that launches the ranks: paths made absolute, every data row
read and tokenised (`prepare_data`), so a bad row is refused before any rank starts."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from distft.config import Config
from distft.config.choices import ITEM_NAMES
from distft.data import (
    data_name,
    mean_label_tokens,
    skipped_line,
)
from distft.data.chat_template import template_path
from distft.data.pairs import run_splits
from distft.model import is_preset, tokenizer_ranks
from distft.plan import truncation_warning
from distft.text import plural


def resolve_local_paths(cfg: Config) -> None:
    """A local data file, model directory, chat template file (data.chat_template) or starting
    adapter (lora.init_adapter), made
    absolute: the run's config.toml then works for the ranks and for `distft eval`/`infer` from
    any directory (a relative path would be read from where they run)."""
    if Path(cfg.data.source).is_file():
        cfg.data.source = str(Path(cfg.data.source).resolve())
    for entry in cfg.data.sources:  # a mixture's files too
        if Path(entry["source"]).is_file():
            entry["source"] = str(Path(entry["source"]).resolve())
    if not is_preset(cfg.model.name) and Path(cfg.model.name).is_dir():
        cfg.model.name = str(Path(cfg.model.name).resolve())
    template = template_path(cfg.data.chat_template)  # None: a template inline, or none
    if template is not None and template.is_file():
        cfg.data.chat_template = str(template.resolve())
    if cfg.lora.init_adapter and Path(cfg.lora.init_adapter).is_dir():
        cfg.lora.init_adapter = str(Path(cfg.lora.init_adapter).resolve())
    if cfg.data.cache_dir:  # every rank, and a resumed run, finds the same cache
        cfg.data.cache_dir = str(Path(cfg.data.cache_dir).expanduser().resolve())


def prepare_data(cfg: Config) -> float | None:
    """Every row read and tokenised before launch, so a bad one is refused here; with `data.cache`
    into the token cache, which the ranks then only open (docs/data.md, "Data at scale"). Returns
    the training rows' mean labelled positions, which the run's prediction counts with."""
    start = time.perf_counter()
    next_line = start + 30

    def progress(examples: int) -> None:  # a line every 30 s of a long first tokenisation
        nonlocal next_line
        if time.perf_counter() >= next_line:
            next_line += 30
            print(
                f"tokenising {data_name(cfg.data)}: {examples:,} examples, {time.perf_counter() - start:.0f} s",
                flush=True,
            )

    # The model's tokenizer and template, or data.chat_template (one that does not parse: refused here).
    name = cfg.model.name
    train, valid, info = run_splits(cfg, None if is_preset(name) else name, tokenizer_ranks(name), progress)
    n = len(train) + len(valid)
    if info["state"] == "built":
        print(f"tokenised {n:,} examples into {info['path']} in {info['seconds']:.1f} s", flush=True)
    elif info["state"] == "hit":
        print(f"token cache: {info['path']} ({n:,} examples, tokenised before)", flush=True)
    elif cfg.train.objective != "sft":  # pairs, held in memory: counted as the run counts them
        item = ITEM_NAMES[cfg.train.objective]
        print(
            f"tokenised {plural(len(train), f'training {item}')} and {plural(len(valid), f'validation {item}')} "
            f"in {info['seconds']:.1f} s",
            flush=True,
        )
    if line := skipped_line({"train": train.summary(), "validation": valid.summary()}):
        print(line, flush=True)
    if 0 < len(train) < cfg.train.global_batch_size:  # valid, but not what the user pictures
        item = ITEM_NAMES[cfg.train.objective]
        print(
            f"distft train: warning: train.global_batch_size={cfg.train.global_batch_size} is more than the "
            f"{plural(len(train), f'training {item}')}: every step repeats {item}s (one step is "
            f"{cfg.train.global_batch_size / len(train):.1f} epochs). Lower train.global_batch_size, or give more rows.",
            file=sys.stderr,
            flush=True,
        )
    label_tokens = mean_label_tokens(train)
    if cut := truncation_warning(cfg, train.summary(), label_tokens):  # beside the rows skipped, said above
        print(f"truncation: {cut}", flush=True)
    return label_tokens
