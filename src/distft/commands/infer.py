"""`distft infer`'s and `distft eval`'s flags. The commands are `distft.infer.commands`'."""

from __future__ import annotations

import argparse

from distft.config.choices import DATA_FORMATS


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
        help="a transcript (text file, or - for standard input), or a .jsonl/.parquet/.csv file of rows, one "
        "output per row (any format `distft train --data` reads; the answer is optional, a chat may end "
        "with a user turn)",
    )
    _add_format_flag(p, "--input")
    _add_data_overrides(p)
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


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="validation loss and ROUGE-L, base model vs finetuned",
        description="Score the base model and the finetuned one on the run's validation split, or on "
        "--data: a .jsonl/.parquet/.csv file (every row, any data format), a hub dataset or `sample` (its "
        "validation split). ROUGE-L compares each row's generated last answer with its own.",
    )
    p.add_argument("--run", required=True, help="run directory written by `distft train`")
    p.add_argument(
        "--data", help="rows to score instead of the run's validation split (any --data distft reads)"
    )
    _add_format_flag(p, "--data")
    _add_data_overrides(p)
    p.add_argument("--rows", type=int, default=16, help="rows (meetings) to score: the first N")
    p.add_argument("--max-new-tokens", type=int, default=96, help="longest generated answer (tokens)")
    p.add_argument("--output", help="write the scores, the rows and the settings as JSON")


def _add_format_flag(p: argparse.ArgumentParser, rows: str) -> None:
    p.add_argument(
        "--format",
        choices=DATA_FORMATS,
        help=f"how to read the {rows} rows (default: the run's data.format); e.g. alpaca for rows "
        "whose input/output fields also fit the qmsum summary schema",
    )


def _add_data_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="data.key=value",
        help="the run's [data] settings changed for these rows, e.g. data.roles='{narrator = \"system\"}' "
        "or data.max_length=2048 (`distft config data` lists them)",
    )
