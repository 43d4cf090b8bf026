"""Every setting with its default and its docstring, read from the schema's source: `distft config`
prints them, and a flag that names a setting (`--lr`) is answered with the key it meant.

The docstring under each field is the documentation (`distft.config.schema`); Python keeps no
reference to a string that follows an assignment, so it is read back from the class's source.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import itertools
import textwrap
import typing
from functools import cache
from pathlib import Path

from distft.config.io import load_config, to_toml, toml_value
from distft.config.schema import Config
from distft.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Setting:
    key: str  # section.name
    type: str
    default: object
    doc: str


@cache
def settings() -> tuple[Setting, ...]:
    """Every key of every section, in schema order."""
    found = []
    defaults = Config()
    for section in dataclasses.fields(Config):
        cls = type(getattr(defaults, section.name))
        docs = _field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            value = getattr(getattr(defaults, section.name), f.name)
            kind = getattr(hints[f.name], "__name__", str(hints[f.name]))
            found.append(Setting(f"{section.name}.{f.name}", kind, value, docs.get(f.name, "")))
    return tuple(found)


def _field_docs(cls: type) -> dict[str, str]:
    """field -> the string literal right after its annotated assignment."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def matching(words: list[str]) -> list[Setting]:
    """The settings a word names: a section (`optim`), a key (`optim.lr`) or a key's name (`lr`),
    else every key containing the word."""
    if not words:
        return list(settings())
    chosen = []
    for word in words:
        word = word.strip().lower().replace("-", "_")
        exact = [s for s in settings() if word in (s.key, s.key.split(".")[0], s.key.split(".")[1])]
        chosen += exact or [s for s in settings() if word in s.key]
    return list({s.key: s for s in chosen}.values())  # once each, in order (a default may be a list)


def render(chosen: list[Setting]) -> str:
    """`section.key = default  (type)` and the docstring under it, wrapped, one blank line apart."""
    blocks = []
    for s in chosen:
        doc = textwrap.fill(s.doc, 96, initial_indent="    ", subsequent_indent="    ") if s.doc else ""
        blocks.append(f"{s.key} = {toml_value(s.default)}  ({s.type})\n{doc}".rstrip())
    return "\n\n".join(blocks)


# The names the anchors give settings distft names otherwise (transformers' TrainingArguments,
# axolotl, LLaMA-Factory), so a flag a user brings along finds its key.
ANCHOR_NAMES = {
    "learning_rate": "optim.lr",
    "num_train_epochs": "train.epochs",
    "num_epochs": "train.epochs",
    "per_device_train_batch_size": "train.micro_batch_size",
    "batch_size": "train.global_batch_size",
    "lora_r": "lora.rank",
    "sequence_len": "data.max_length",
    "max_seq_length": "data.max_length",
    "cutoff_len": "data.max_length",
    "output_dir": "output.dir",
    "base_model": "model.name",
    "model_name_or_path": "model.name",
    "lr_scheduler_type": "optim.scheduler",
    "max_grad_norm": "optim.grad_clip",
    "optim": "optim.name",
    "logging_steps": "train.log_every",
    "eval_steps": "train.eval_every",
    "save_steps": "output.checkpoint_every",
    "save_total_limit": "output.keep_last",
}
# TrainingArguments' switches, and a count distft derives: the whole override each one means.
ANCHOR_SETTINGS = {
    "bf16": "model.dtype=bfloat16",
    "fp16": "model.dtype=bfloat16 (distft trains in float32 or bfloat16)",
    "gradient_checkpointing": "model.activation_checkpointing=full",
    "torch_compile": "model.compile=true",
    "gradient_accumulation_steps": "train.global_batch_size=N (micro-batch x accumulation steps x "
    "data-parallel ranks: the accumulation follows from it)",
}


def flag_meant(flag: str) -> str | None:
    """`--lr`, `--warmup-steps=5`: the `section.key=value` override a stray flag most likely meant."""
    name, _, value = flag.lstrip("-").partition("=")
    name = name.replace("-", "_").lower()
    if not name:
        return None
    if name in ANCHOR_SETTINGS:
        return ANCHOR_SETTINGS[name]
    keys = [s.key for s in settings()]
    dotted = name.replace("_", ".", 1)  # --lora-rank: lora.rank
    exact = [k for k in keys if k.split(".")[1] == name or k == dotted]
    if not exact and name in ANCHOR_NAMES:
        exact = [ANCHOR_NAMES[name]]
    close = exact or difflib.get_close_matches(name, [k.split(".")[1] for k in keys], n=1, cutoff=0.75)
    if not close:
        return None
    key = close[0] if "." in close[0] else next(k for k in keys if k.split(".")[1] == close[0])
    return f"{key}={value or 'VALUE'}"


# ---- `distft config` ----------------------------------------------------------------------------

SEE_SETTINGS = (
    "Settings are section.key=value overrides (optim.lr=1e-4) or a --config TOML file: `distft config` "
    "lists every one with its default and meaning, `distft config lr` the ones a word names, and "
    "`distft train ... --print-config` the config a run would use."
)


def add_config_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "config",
        help="every setting with its default and meaning, or the resolved config of a run",
        description="Every setting of a run with its default and its meaning (the docstring in the schema). "
        "Words narrow the list: a section (optim), a key (optim.lr) or part of one (warmup).",
    )
    p.add_argument("words", nargs="*", metavar="WORD", help="sections, keys or parts of keys to show")
    p.add_argument("--run", metavar="DIR", help="print the resolved config of the run in DIR instead")


def cmd_config(args: argparse.Namespace) -> int:
    if args.run:
        path = Path(args.run) / "config.toml"
        if not path.is_file():
            raise ConfigError(f"--run {args.run}: no config.toml there; it is not a distft run directory.")
        print(to_toml(load_config(path, run=True)), end="")
        return 0
    chosen = matching(args.words)
    if not chosen:
        raise ConfigError(f"No setting is named by {' '.join(args.words)!r}; `distft config` lists them all.")
    print(render(chosen))
    return 0
