"""`distft export`'s flags, and the dtypes each format writes (`distft.export`,
`distft.export_gguf` read them from here). The command is `distft.export_command`'s."""

from __future__ import annotations

import argparse

from distft.errors import ConfigError

EXPORT_DTYPES = ("bfloat16", "float32")  # --format safetensors: a transformers model
GGUF_DTYPES = ("float32", "float16", "bfloat16", "q8_0")  # --format gguf


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="merge a run's adapter into its base: one transformers model, or a GGUF file",
        description="Write a finished run as a plain transformers model (config.json + safetensors), "
        "the LoRA/QLoRA adapter merged into its base, with the tokenizer, its chat template and a model "
        "card; loadable with AutoModelForCausalLM/AutoTokenizer.from_pretrained. --format gguf writes one "
        "GGUF file for llama.cpp and Ollama instead, merged or (--adapter-only) the adapter alone. See "
        "docs/export.md.",
    )
    p.add_argument("--run", required=True, help="run directory written by `distft train`")
    p.add_argument(
        "--out",
        required=True,
        help="directory to write (new, empty, or an earlier export); --format gguf: a .gguf file or a directory",
    )
    p.add_argument("--format", choices=("safetensors", "gguf"), default="safetensors", help="what to write")
    p.add_argument(
        "--dtype",
        choices=GGUF_DTYPES,
        default="bfloat16",
        help=f"weight dtype of the export (safetensors: {', '.join(EXPORT_DTYPES)}; gguf: any)",
    )
    p.add_argument(
        "--adapter-only",
        action="store_true",
        help="--format gguf: the LoRA adapter alone (llama.cpp's --lora)",
    )
    p.add_argument("--push-to-hub", metavar="REPO", help="also upload to this hub repository (user/name)")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")
    p.set_defaults(check=check_export_flags)


def check_export_flags(args: argparse.Namespace) -> None:
    """Flags that do not go together, refused before the command's imports (torch)."""
    if args.format == "gguf" and args.push_to_hub:
        raise ConfigError(
            "--push-to-hub uploads a transformers export; push a GGUF file with huggingface-cli upload."
        )
    if args.format == "safetensors" and (args.adapter_only or args.dtype not in EXPORT_DTYPES):
        what = "--adapter-only" if args.adapter_only else f"--dtype {args.dtype}"
        raise ConfigError(
            f"{what} is for --format gguf; a transformers export takes --dtype {' or '.join(EXPORT_DTYPES)}."
        )
