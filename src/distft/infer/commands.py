"""`distft infer` and `distft eval`: what they run and print (their flags: `distft.commands.infer`).

Flags are checked before the model is loaded, so a mistake costs no load time: one paragraph,
exit code 2 (`ConfigError`, reported by `distft.cli`). Notices (a preset base, a truncated
transcript) go to standard error, so standard output holds only what was asked for.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import asdict, replace
from pathlib import Path

from rich.table import Table

from distft.config import DataConfig, apply_override, check_fields, load_config
from distft.data import (
    ChatRow,
    Message,
    Row,
    SummaryRow,
    data_name,
    is_local_file,
    iter_file,
    prompt_and_reference,
    validation_rows,
)
from distft.data.preference import PreferenceRow
from distft.errors import ConfigError, DataError
from distft.infer.evaluate import compare, eval_rows, without_reference
from distft.infer.generate import Generated, Sampling, generate, results_file, truncation_notice
from distft.infer.load import Loaded, load_trained, preset_notice
from distft.io.files import atomic_write_text
from distft.io.lineage import base_stages, is_random, origin_text, run_stage, stage_text
from distft.io.preflight import check_output_path
from distft.text import console, plural
from distft.textfiles import decode_utf8

# ---- infer --------------------------------------------------------------------------------------


def check_data_overrides(overrides: list[str]) -> None:
    """Each override names a [data] setting with a valid value (checked on the defaults, before the
    model loads); the model and adapter are the run's, so other sections are refused."""
    for item in overrides:
        if not item.strip().startswith("data."):
            raise ConfigError(
                f"`{item}`: infer and eval take [data] settings only (how rows are read and rendered); "
                "the model, adapter and training settings are the run's."
            )
    load_config(None, overrides)


def _with_data(loaded: Loaded, fmt: str | None, overrides: list[str]) -> Loaded:
    """The run, its rows read with the [data] overrides and as `fmt` (--format) when given."""
    cfg = copy.deepcopy(loaded.cfg)
    for item in overrides:
        apply_override(cfg, item)
    if fmt:
        cfg.data.format = fmt
    check_fields(cfg)
    return replace(loaded, cfg=cfg)


def sampling_from_args(args: argparse.Namespace) -> Sampling:
    """The decoding settings the flags ask for; a contradiction or a bad value is a ConfigError."""
    given = {
        flag: value
        for flag, value in (
            ("--temperature", args.temperature),
            ("--top-p", args.top_p),
            ("--top-k", args.top_k),
        )
        if value is not None
    }
    if args.greedy and given:
        raise ConfigError(
            f"--greedy picks the most likely token, so {', '.join(given)} would be ignored; drop --greedy "
            "to sample, or drop the sampling flags."
        )
    sampling = Sampling(
        max_new_tokens=args.max_new_tokens,
        greedy=not given,
        temperature=1.0 if args.temperature is None else args.temperature,
        top_p=1.0 if args.top_p is None else args.top_p,
        top_k=0 if args.top_k is None else args.top_k,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )
    sampling.check()
    return sampling


def cmd_infer(args: argparse.Namespace) -> int:
    sampling = sampling_from_args(args)
    batch = bool(args.input) and is_local_file(args.input)
    if args.input and args.input != "-" and not os.path.isfile(args.input):
        raise ConfigError(f"--input {args.input} does not exist.")
    text = read_input(args.input) if args.input and not batch else None  # refused before the model loads
    if args.output:  # before minutes of generation
        check_output_path(Path(args.output), "--output")
    check_data_overrides(args.overrides)
    loaded = load_trained(run=args.run, adapter=args.adapter, model=args.model)
    loaded = _with_data(loaded, args.format, args.overrides)
    sampling.check_room(loaded.cfg.data.max_length)
    if notice := preset_notice(loaded):
        print(notice, file=sys.stderr)
    n, meetings = 0, True
    output = results_file(Path(args.output), loaded.cfg.data) if args.output else contextlib.nullcontext()
    with output as write:
        # A file is read a row at a time, and each result written as it comes: constant memory.
        for row in _input_rows(loaded, args.input, batch, text):
            result = generate(loaded, row, sampling)
            if notice := truncation_notice(loaded, row, result, sampling):
                print(notice, file=sys.stderr)
            if write:
                write(row, result)
            else:
                _print_result(row, result, batch, loaded.cfg.data)
            n, meetings = n + 1, meetings and isinstance(row, SummaryRow)
    if args.output:
        noun = ("summary", "summaries") if meetings else ("response", "responses")
        print(f"wrote {n} {noun[n != 1]} to {args.output}")
    return 0


def _text_row(text: str, origin: str, cfg: DataConfig, seed: int) -> Row:
    """A plain-text input: a meeting transcript where the run trained on meetings, else the user turn."""
    if _trained_on_meetings(cfg, seed):
        return SummaryRow(text, "", origin)
    return ChatRow((Message("user", (text.strip(),)),), origin)


def _trained_on_meetings(cfg: DataConfig, seed: int) -> bool:
    """data.format, or where it is auto, the format its rows were detected as (the first held-out
    row's; a source no longer there: meetings, the default workload)."""
    if cfg.format != "auto":
        return cfg.format == "summary"
    try:
        rows = validation_rows(cfg, seed=seed, limit=1)
    except (ConfigError, DataError, OSError):
        return True
    return not rows or isinstance(rows[0], SummaryRow)


def _input_rows(loaded: Loaded, source: str | None, batch: bool, text: str | None) -> Iterable[Row]:
    if batch:
        rows = iter_file(source, loaded.cfg.data, need_answer=False)
        first = next(rows, None)
        if first is None:
            raise ConfigError(f"--input {source} has no rows to generate for.")
        return itertools.chain([first], rows)
    if text is not None:  # --input FILE or -, read by `read_input`
        return [_text_row(text, "stdin" if source == "-" else source, loaded.cfg.data, loaded.cfg.train.seed)]
    (row,) = validation_rows(loaded.cfg.data, seed=loaded.cfg.train.seed, limit=1)
    if isinstance(row, SummaryRow):
        print("--- held-out meeting (first lines) ---")
        print("\n".join(row.transcript.splitlines()[:6]) + "\n...")
    else:
        prompt, _ = prompt_and_reference(row, loaded.cfg.data)
        print(f"--- held-out row {row.origin}: its last prompt turn (first lines) ---")
        print("\n".join(prompt[-1].content.splitlines()[:6] if prompt else []) + "\n...")
    return [row]


def read_input(source: str) -> str:
    """The text of `--input FILE` (or standard input, `-`); a DataError for one that is not UTF-8
    text, naming what it looks like (UTF-16, binary) or the line of the first byte that is not UTF-8."""
    name = "standard input" if source == "-" else f"--input {source}"
    try:
        data = sys.stdin.buffer.read() if source == "-" else Path(source).read_bytes()
    except OSError as err:
        raise DataError(f"{name} cannot be read ({err.strerror or err}).") from None
    return decode_utf8(data, name, DataError)


def _print_result(row: Row, result: Generated, batch: bool, cfg: DataConfig) -> None:
    if batch:
        print(f"--- {row.origin} ---")
    else:
        print("--- generated summary ---" if isinstance(row, SummaryRow) else "--- generated answer ---")
    print(result.summary)
    if batch:
        return
    # The held-out row's own answer, whatever its format (a user's --input has none).
    meeting = isinstance(row, SummaryRow)
    reference = row.summary if meeting else prompt_and_reference(row, cfg)[1]
    if reference:
        print(f"--- reference {'summary' if meeting else 'answer'} (held out, never trained on) ---")
        print(reference)


# ---- eval ---------------------------------------------------------------------------------------


def cmd_eval(args: argparse.Namespace) -> int:
    if args.rows < 1:
        raise ConfigError(f"--rows must be at least 1, got {args.rows}: it is how many meetings to score.")
    Sampling(max_new_tokens=args.max_new_tokens).check()
    if args.output:
        check_output_path(Path(args.output), "--output")
    check_data_overrides(args.overrides)
    loaded = _with_data(load_trained(run=args.run), args.format, args.overrides)
    Sampling(max_new_tokens=args.max_new_tokens).check_room(loaded.cfg.data.max_length)
    if notice := preset_notice(loaded):
        print(notice, file=sys.stderr)
    rows = eval_rows(loaded, args.data, args.rows)
    scores = compare(loaded, args.run, rows, args.max_new_tokens)
    source = args.data or f"{data_name(loaded.cfg.data)} (validation split)"
    kinds = {"meetings": SummaryRow, "pairs": PreferenceRow}
    what = next((name for name, kind in kinds.items() if all(isinstance(r, kind) for r in rows)), "rows")
    pairs = "preference_accuracy" in scores["finetuned"]  # preference rows: which answer each prefers
    extra = ("prefers chosen", "log-prob margin") if pairs else ()
    table = Table(
        "model", "what", "loss", "ROUGE-L", *extra, title=f"{args.run}: {len(rows)} {what} of {source}"
    )
    labels = model_labels(loaded)
    for name, s in scores.items():
        rouge = "n/a" if s["rougeL"] is None else f"{s['rougeL']:.4f}"
        preferred = (f"{s['preference_accuracy']:.0%}", f"{s['preference_margin']:+.3f}") if pairs else ()
        table.add_row(name, labels.get(name, ""), f"{s['loss']:.4f}", rouge, *preferred)
    console().print(table)
    if unscored := without_reference(loaded, rows):  # their ROUGE-L would read as a zero score
        rest = len(rows) - unscored
        mean = f"the mean is over the other {plural(rest, 'row')}" if rest else "no row has one: n/a"
        print(
            f"ROUGE-L skips {plural(unscored, 'row')} of {len(rows)} without a reference answer (a text "
            f"row is all prompt); {mean}",
            file=sys.stderr,
        )
    if args.output:
        results = {
            "run": str(args.run),
            "data": source,
            "rows": [r.origin for r in rows],
            "settings": {**asdict(Sampling(max_new_tokens=args.max_new_tokens)), "rows": len(rows)},
            "models": scores,
        }
        atomic_write_text(Path(args.output), json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.output}")
    return 0


def model_labels(loaded: Loaded) -> dict[str, str]:
    """What each row of the eval table is: the random preset, then each training stage on top."""
    cfg, lineage = loaded.cfg, loaded.lineage
    if not is_random(lineage):
        return {"base": cfg.model.name, "finetuned": f"+ {stage_text(run_stage(cfg))}"} | start_label(cfg)
    earlier, last = base_stages(lineage), lineage["stages"][-1]
    labels = {"untrained": origin_text(lineage), "base": origin_text(lineage)}
    if earlier:
        labels["base"] = "+ " + ", + ".join(stage_text(s) for s in earlier)
    labels["finetuned"] = "+ " + stage_text(last, loaded.run)
    return labels | start_label(cfg)


def start_label(cfg) -> dict[str, str]:
    """The eval table's row of the adapter a run started from (`lora.init_adapter`), if any."""
    return {"start": f"+ the adapter of {cfg.lora.init_adapter}"} if cfg.lora.init_adapter else {}
