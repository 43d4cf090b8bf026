"""`distft export`: a finished run as one transformers model (`distft.export`) or one GGUF file
(`distft.export_gguf`), by --format; its flags are `distft.commands.export`'s."""

from __future__ import annotations

import argparse

from distft.commands.export import EXPORT_DTYPES
from distft.errors import ConfigError
from distft.export import export_run
from distft.export_gguf import export_gguf


def cmd_export(args: argparse.Namespace) -> int:
    if args.format == "gguf":
        if args.push_to_hub:
            raise ConfigError(
                "--push-to-hub uploads a transformers export; push a GGUF file with huggingface-cli upload."
            )
        out = export_gguf(args.run, args.out, args.dtype, args.adapter_only)
        print(
            f"exported {args.run} to {out} (GGUF, {'adapter' if args.adapter_only else 'merged'}, {args.dtype})"
        )
        return 0
    if args.adapter_only or args.dtype not in EXPORT_DTYPES:
        what = "--adapter-only" if args.adapter_only else f"--dtype {args.dtype}"
        raise ConfigError(
            f"{what} is for --format gguf; a transformers export takes --dtype {' or '.join(EXPORT_DTYPES)}."
        )
    out = export_run(args.run, args.out, args.dtype, args.push_to_hub, args.private)
    print(f"exported {args.run} to {out} ({args.dtype})")
    if args.push_to_hub:
        print(f"uploaded to https://huggingface.co/{args.push_to_hub}")
    return 0
