"""Every command's flags and help, for the parser of `distft.cli`: light modules (argparse,
`distft.config`, tables of names), so that `distft --help`, `distft config` and a refused setting
import no torch. Each command runs in its own module, which the CLI imports when it runs
(`distft.cli.COMMANDS`).

A fact a help text names whose home imports torch (the strategy registry, the planner's
precisions and links, bench's studies) is a light table of names here, each held equal to its
source by tests/test_cli_startup.py; the defaults these flags own (bench's, export's dtypes,
doctor's sizes) are defined here and read by the commands.
"""
