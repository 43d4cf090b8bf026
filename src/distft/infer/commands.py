"""`distft infer` and `distft eval`: their flags and what they print.

Flags are checked before the model is loaded, so a mistake costs no load time: one paragraph,
exit code 2 (`ConfigError`, reported by `distft.cli`). Notices (a preset base, a truncated
transcript) go to standard error, so standard output holds only what was asked for.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import asdict, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from distft.config import DataConfig
from distft.config.choices import DATA_FORMATS
from distft.data import (
    LOCAL_SUFFIXES,
    ChatRow,
    Message,
    Row,
    SummaryRow,
    data_name,
    iter_file,
    prompt_and_reference,
    validation_rows,
)
from distft.errors import ConfigError, DataError
from distft.infer.evaluate import compare, eval_rows, without_reference
from distft.infer.generate import Generated, Sampling, generate, results_file, truncation_notice
from distft.infer.load import Loaded, load_trained, preset_notice
from distft.io.files import atomic_write_text
from distft.io.lineage import is_random, origin_text, stage_text
from distft.io.preflight import check_output_path
from distft.text import plural
from distft.textfiles import decode_utf8

# ---- infer --------------------------------------------------------------------------------------


def add_infer_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "infer",
        help="summarise a meeting (or answer a file of rows in any data format) with a trained run",
        description="Load base model + adapter and generate summaries (or answers). With no --input: a "
        "held-out row from the run's validation split. Decoding is greedy unless --temperature, --top-p "
        "or --top-k is given.",
    )
    p.add_argument("--run", help="run directory written by `distft train`")
    p.add_argument("--adapter", help="a PEFT adapter directory (instead of --run)")
    p.add_argument(
        "--model", help="base model for --adapter (default: the adapter's base_model_name_or_path)"
    )
    p.add_argument(
        "--input",
        help="a transcript (text file, or - for standard input), or a .jsonl/.parquet file of rows, one "
        "output per row (any format `distft train --data` reads; the answer is optional, a chat may end "
        "with a user turn)",
    )
    _add_format_flag(p, "--input")
    p.add_argument(
        "--output",
        help="write the outputs as JSON lines: origin, summary (response for non-meeting rows), prompt "
        "and dropped tokens, reference",
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="longest summary to generate (tokens)")
    g = p.add_argument_group("decoding")
    g.add_argument("--greedy", action="store_true", help="the most likely token at every step (the default)")
    g.add_argument("--temperature", type=float, help="sample, with the logits divided by T")
    g.add_argument("--top-p", type=float, help="sample from the smallest set of tokens with probability P")
    g.add_argument("--top-k", type=int, help="sample from the K most likely tokens")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="penalise repeated tokens (1: off)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed, set before every row")


def _add_format_flag(p: argparse.ArgumentParser, rows: str) -> None:
    p.add_argument(
        "--format",
        choices=DATA_FORMATS,
        help=f"how to read the {rows} rows (default: the run's data.format); e.g. alpaca for rows "
        "whose input/output fields also fit the qmsum summary schema",
    )


def _with_format(loaded: Loaded, fmt: str | None) -> Loaded:
    """The run, its rows read as `fmt` (--format) when given."""
    return (
        replace(loaded, cfg=replace(loaded.cfg, data=replace(loaded.cfg.data, format=fmt))) if fmt else loaded
    )


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
    batch = bool(args.input) and args.input.endswith(LOCAL_SUFFIXES)
    if args.input and args.input != "-" and not os.path.isfile(args.input):
        raise ConfigError(f"--input {args.input} does not exist.")
    text = read_input(args.input) if args.input and not batch else None  # refused before the model loads
    if args.output:  # before minutes of generation
        check_output_path(Path(args.output), "--output")
    loaded = _with_format(load_trained(run=args.run, adapter=args.adapter, model=args.model), args.format)
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


def _text_row(text: str, origin: str, cfg: DataConfig) -> Row:
    """A plain-text input: a meeting transcript, or the user turn when the run trained on another format."""
    if cfg.format in ("auto", "summary"):
        return SummaryRow(text, "", origin)
    return ChatRow((Message("user", (text.strip(),)),), origin)


def _input_rows(loaded: Loaded, source: str | None, batch: bool, text: str | None) -> Iterable[Row]:
    if batch:
        rows = iter_file(source, loaded.cfg.data, need_answer=False)
        first = next(rows, None)
        if first is None:
            raise ConfigError(f"--input {source} has no rows to generate for.")
        return itertools.chain([first], rows)
    if text is not None:  # --input FILE or -, read by `read_input`
        return [_text_row(text, "stdin" if source == "-" else source, loaded.cfg.data)]
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


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="validation loss and ROUGE-L, base model vs finetuned",
        description="Score the base model and the finetuned one on the run's validation split, or on "
        "--data: a .jsonl/.parquet file (every row, any data format), a hub dataset or `sample` (its "
        "validation split). ROUGE-L compares each row's generated last answer with its own.",
    )
    p.add_argument("--run", required=True, help="run directory written by `distft train`")
    p.add_argument(
        "--data", help="rows to score instead of the run's validation split (any --data distft reads)"
    )
    _add_format_flag(p, "--data")
    p.add_argument("--rows", type=int, default=16, help="rows (meetings) to score: the first N")
    p.add_argument("--max-new-tokens", type=int, default=96, help="longest generated answer (tokens)")
    p.add_argument("--output", help="write the scores, the rows and the settings as JSON")


def cmd_eval(args: argparse.Namespace) -> int:
    if args.rows < 1:
        raise ConfigError(f"--rows must be at least 1, got {args.rows}: it is how many meetings to score.")
    Sampling(max_new_tokens=args.max_new_tokens).check()
    if args.output:
        check_output_path(Path(args.output), "--output")
    loaded = _with_format(load_trained(run=args.run), args.format)
    Sampling(max_new_tokens=args.max_new_tokens).check_room(loaded.cfg.data.max_length)
    if notice := preset_notice(loaded):
        print(notice, file=sys.stderr)
    rows = eval_rows(loaded, args.data, args.rows)
    scores = compare(loaded, args.run, rows, args.max_new_tokens)
    source = args.data or f"{data_name(loaded.cfg.data)} (validation split)"
    what = "meetings" if all(isinstance(r, SummaryRow) for r in rows) else "rows"
    table = Table("model", "what", "loss", "ROUGE-L", title=f"{args.run}: {len(rows)} {what} of {source}")
    labels = model_labels(loaded)
    for name, s in scores.items():
        rouge = "n/a" if s["rougeL"] is None else f"{s['rougeL']:.4f}"
        table.add_row(name, labels.get(name, ""), f"{s['loss']:.4f}", rouge)
    Console().print(table)
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
        return {"base": cfg.model.name, "finetuned": f"+ {cfg.train.max_steps} steps of {cfg.train.method}"}
    *earlier, last = lineage["stages"]
    labels = {"untrained": origin_text(lineage), "base": origin_text(lineage)}
    if earlier:
        labels["base"] = "+ " + ", + ".join(stage_text(s) for s in earlier)
    labels["finetuned"] = "+ " + stage_text(last, loaded.run)
    return labels
