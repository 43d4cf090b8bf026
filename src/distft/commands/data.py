"""`distft data preview`'s flags. The command is `distft.train.preview`'s."""

from __future__ import annotations

import argparse


def add_data_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "data",
        help="look at the training data as a run sees it",
        description="Look at the training data as `distft train` would see it, before training.",
    )
    actions = p.add_subparsers(dest="data_command", required=True, metavar="COMMAND")
    q = actions.add_parser(
        "preview",
        help="the first training rows, tokenised, with the tokens that carry loss marked",
        description="Print the first training rows as the run tokenises them: the data format, the "
        "decoded text with every token that carries loss inside [[...]], and the counts (tokens, "
        "trained tokens, truncation); a preference pair shows its chosen and its rejected side, each so, "
        "as train.objective trains them. Settings as for `distft train`. See docs/data.md.",
    )
    q.add_argument("--config", help="TOML file, as for `distft train --config`")
    q.add_argument("--model", help="the model whose tokenizer and chat template to use (as for train)")
    q.add_argument("--data", help="the rows (as for train): sample, a .jsonl/.parquet/.csv file, a hub id")
    q.add_argument("--rows", type=int, default=1, help="how many training rows to show (default 1)")
    q.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="config overrides, e.g. data.max_length=512"
    )
