"""`distft export`: a finished run as one transformers model (`distft.export`) or one GGUF file
(`distft.export_gguf`), by --format; its flags are `distft.commands.export`'s."""

from __future__ import annotations

import argparse

from distft.commands.export import check_export_flags
from distft.export import export_run
from distft.export_gguf import export_gguf


def cmd_export(args: argparse.Namespace) -> int:
    check_export_flags(args)  # the CLI checked them before importing this module; a caller may not have
    if args.format == "gguf":
        out = export_gguf(args.run, args.out, args.dtype, args.adapter_only)
        print(
            f"exported {args.run} to {out} (GGUF, {'adapter' if args.adapter_only else 'merged'}, {args.dtype})"
        )
        return 0
    out = export_run(args.run, args.out, args.dtype, args.push_to_hub, args.private)
    print(f"exported {args.run} to {out} ({args.dtype})")
    if args.push_to_hub:
        print(f"uploaded to https://huggingface.co/{args.push_to_hub}")
    return 0
