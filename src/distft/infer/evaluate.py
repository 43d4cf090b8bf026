"""Scoring a trained run: validation loss and ROUGE-L, the base model against the finetuned one
(and, on preference rows, how often each finds the chosen answer more likely than the rejected).

The rows come from the run's own validation split (never trained on), or from any source distft
reads (`--data`), in any of its formats: a local .jsonl/.parquet/.csv file from its first row, a hub
dataset or `sample` by its validation split. Either way only the rows scored are held in memory
(`distft.data.validation_rows`): scoring 16 rows of a set of millions keeps none of the rest.
Loss is the mean over the answer tokens of the whole row, tokenised as in training
(`ChatFormatter.encode`: every assistant turn of a chat); ROUGE-L compares the greedy answer to a
row's prompt (its turns before the last assistant turn) with that last turn (a meeting's summary).
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from distft.data import (
    ChatFormatter,
    Row,
    collate,
    count_label_tokens,
    is_local_file,
    iter_file,
    prompt_and_reference,
    tokenize_rows,
    validation_rows,
)
from distft.data.pairs import encode_pairs, rows_of
from distft.data.preference import PreferenceRow
from distft.errors import ConfigError
from distft.infer.generate import Sampling, generate
from distft.infer.load import Loaded, _load_base
from distft.io.lineage import base_stages, is_random
from distft.model import LossLM
from distft.model.build import peft_quietly, rebuild_base
from distft.model.preference import sequence_logps
from distft.model.start import adapter_directory


def eval_rows(loaded: Loaded, data: str | None = None, max_rows: int = 16) -> list[Row]:
    """The first `max_rows` rows to score: the run's validation split, or those of `data`."""
    if max_rows < 1:
        raise ConfigError(f"--rows must be at least 1, got {max_rows}: it is how many meetings to score.")
    cfg = loaded.cfg
    if data is not None and is_local_file(data):
        rows = list(itertools.islice(iter_file(data, cfg.data), max_rows))  # a user's own file: no split
    else:
        # --data (a hub id) replaces the run's rows, a mixture's too
        source = replace(cfg.data, max_rows=0, **({"source": data, "sources": []} if data else {}))
        rows = validation_rows(source, seed=cfg.train.seed, limit=max_rows)
    if not rows:
        raise ConfigError(f"--data {data}: no rows to score; each needs a prompt and its answer.")
    return rows


@torch.no_grad()
def validation_loss(model: nn.Module, loaded: Loaded, rows: list[Row]) -> float:
    """Mean loss per answer token over `rows` (tokenised as in training), in micro-batches of the run's size."""
    formatter = ChatFormatter(loaded.tokenizer, loaded.cfg.data)
    examples = tokenize_rows(rows, formatter).examples
    head = LossLM(model)
    loss, n = 0.0, 0
    mb = loaded.cfg.train.micro_batch_size
    for i in range(0, len(examples), mb):
        batch = examples[i : i + mb]
        loss += head(**collate(batch, loaded.tokenizer.pad_token_id)).item()
        n += count_label_tokens(batch)
    return loss / n


def score(loaded: Loaded, rows: list[Row], max_new_tokens: int) -> dict[str, float | None]:
    """Loss and mean ROUGE-L F1 of `loaded.model` on `rows`: each row's greedy answer against its
    own. A row without a reference (a text row, which is all prompt) has no ROUGE-L: it is not
    generated for and the mean skips it, rather than counting a zero; no row with one, None."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    greedy = Sampling(max_new_tokens=max_new_tokens)
    rouge = []
    for row in rows:
        reference = prompt_and_reference(row, loaded.cfg.data)[1]
        if reference.strip():
            rouge.append(scorer.score(reference, generate(loaded, row, greedy).summary)["rougeL"].fmeasure)
    mean = sum(rouge) / len(rouge) if rouge else None
    scores = {"loss": validation_loss(loaded.model, loaded, rows), "rougeL": mean}
    pairs = [row for row in rows if isinstance(row, PreferenceRow)]
    return scores | (preference_scores(loaded, pairs) if pairs else {})


@torch.no_grad()
def preference_scores(loaded: Loaded, rows: list[PreferenceRow]) -> dict[str, float]:
    """Of preference rows: the share of pairs whose chosen answer the model finds more likely than
    the rejected one (log-probability, `distft.model.preference.sequence_logps`), and the mean
    margin of log-probabilities, chosen minus rejected."""
    pairs, _ = encode_pairs(ChatFormatter(loaded.tokenizer, loaded.cfg.data), rows, loaded.cfg.dpo)
    head, margins = LossLM(loaded.model), []
    mb = loaded.cfg.train.micro_batch_size
    for i in range(0, len(pairs), mb):
        batch = collate(rows_of(pairs[i : i + mb]), loaded.tokenizer.pad_token_id)
        hidden = head.hidden_states(batch["input_ids"], batch["attention_mask"], None)
        chosen, rejected = sequence_logps(hidden, head.lm_head, batch["labels"])[0].chunk(2)
        margins += (chosen - rejected).tolist()
    return {
        "preference_accuracy": sum(m > 0 for m in margins) / len(margins),
        "preference_margin": sum(margins) / len(margins),
    }


def without_reference(loaded: Loaded, rows: list[Row]) -> int:
    """How many of `rows` have no reference answer, so no ROUGE-L (`score` skips them)."""
    return sum(not prompt_and_reference(row, loaded.cfg.data)[1].strip() for row in rows)


def compare(
    loaded: Loaded, run: str, rows: list[Row], max_new_tokens: int
) -> dict[str, dict[str, float | None]]:
    """{"base": scores, "finetuned": scores}: the adapter switched off (or the base reloaded) and on;
    {"start": scores} too for a run from `lora.init_adapter`, that adapter in the run's place.
    A base that is itself a trained random preset (`make demo`'s LoRA stage on its stage-1 model)
    also gets {"untrained": scores}: the random preset the chain started from, rebuilt."""
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {max_new_tokens}.")
    scores = {}
    if (untrained := untrained_model(loaded)) is not None:
        scores["untrained"] = score(replace(loaded, model=untrained.eval()), rows, max_new_tokens)
    finetuned = score(loaded, rows, max_new_tokens)
    if loaded.has_adapter:
        with loaded.model.disable_adapter():
            scores["base"] = score(loaded, rows, max_new_tokens)
        if start := loaded.cfg.lora.init_adapter:  # the trained adapter the run started from
            scores["start"] = start_scores(loaded, start, rows, max_new_tokens)
    else:
        run_base = Path(run) / "base"
        base_model = _load_base(str(run_base) if run_base.is_dir() else loaded.cfg.model.name, loaded.cfg)
        scores["base"] = score(replace(loaded, model=base_model.eval()), rows, max_new_tokens)
    return {**scores, "finetuned": finetuned}


def start_scores(loaded: Loaded, path: str, rows: list[Row], max_new_tokens: int) -> dict[str, float | None]:
    """The scores of the base with `lora.init_adapter`: loaded beside the run's adapter, active
    while it is scored."""
    with peft_quietly():
        loaded.model.load_adapter(str(adapter_directory(path)), adapter_name="start")
    loaded.model.set_adapter("start")
    try:
        return score(loaded, rows, max_new_tokens)
    finally:
        loaded.model.set_adapter("default")
        loaded.model.delete_adapter("start")


def untrained_model(loaded: Loaded) -> nn.Module | None:
    """The random preset `loaded` descends from, when its base was trained before this run (the
    lineage has base stages, `base_stages`); None when the base is that preset itself, or pretrained."""
    lineage = loaded.lineage
    if not is_random(lineage) or not base_stages(lineage):
        return None
    try:
        return rebuild_base(lineage["origin"])
    except ConfigError:  # initialised on CUDA, scored without one: the row is left out
        return None
