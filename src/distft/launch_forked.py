"""`distft.launch` for CPU runs: every rank is forked from a launcher that imported distft once.

Started by torchrun the usual way, each rank is a fresh `python -m distft.cli` that spends ~5 s of
CPU importing torch, transformers and peft before its first line runs, and N ranks pay it N times
on the same cores. This launcher imports them once and forks the ranks (torchrun's own
`--start-method fork` for function entrypoints), so they start with everything loaded; a restart
(`--max-restarts`) forks again from the same clean launcher, which never trains.

CPU only: a process must not fork once it has touched CUDA, and importing the stack may (torchao
probes the device's capability), so CUDA runs keep torchrun's exec (`distft.launch`). The choice is
the CLI's (`distributed.torchrun_command(fork=...)`), made where it already knows the device.
"""

from __future__ import annotations

import os
import sys

from distft import launch
from distft.cli import main as cli_main
from distft.distributed import FORKED_ENV


def run_rank(argv: list[str]) -> None:
    """One rank: `distft ARGV`; a non-zero exit code fails the rank, as an exec'd one would."""
    code = cli_main(argv)
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    os.environ[FORKED_ENV] = "1"  # inherited by the ranks: `exit_worker` returns instead of `os._exit`
    sys.exit(launch.main(entrypoint=run_rank))
