"""torchrun, reporting a failed run in one paragraph instead of the agent's traceback.

`python -m distft.launch ARGS` takes exactly torchrun's arguments and runs its elastic agent in
this process. When ranks fail for good (after `--max-restarts` restarts), torchrun itself raises
`ChildFailedError` out of its `main`, printing a Python traceback of the agent under the ranks'
own messages; here the failure is summarised instead (which rank, its exit code or signal) and
the exit code is 1. The ranks' own output, including their error paragraphs, is untouched.

Restarts (`--max-restarts`) need the rendezvous store unshared. By default torchrun's agent keeps
one TCPStore for all attempts and the ranks build their process group in it without a per-attempt
prefix, so a restarted rank can read a key its dead predecessor wrote (gloo: "connectFullMesh
failed ... Connection refused" to the dead rank's old port; NCCL: a stale unique id): one of the
first two killed-rank runs here. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each attempt a fresh
store (pytorch/pytorch#135712); with it, every killed-rank run here has restarted cleanly.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Callable


def main(argv: list[str] | None = None, entrypoint: Callable[[list[str]], None] | None = None) -> int:
    """torchrun ARGV. With `entrypoint`, each rank is a process forked from this one that calls
    `entrypoint(script_args)` instead of exec'ing the script (`distft.launch_forked`)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.max_restarts:
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        if entrypoint is None:
            run(args)
        else:
            if args.standalone:  # what torch.distributed.run.run does before it launches
                args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
            args.start_method = "fork"
            # A failed forked rank is logged with the traceback of the launcher's own wait for it
            # (an exec'd one without): the rank's message and the summary below say it all.
            logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_without_traceback)
            config, _, _ = config_from_args(args)
            elastic_launch(config, entrypoint)(list(args.training_script_args))
    except ChildFailedError as err:

        def how(failure) -> str:
            return (
                f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
            )

        rank, first = err.get_first_failure()
        others = "; ".join(f"rank {r}: {how(f)}" for r, f in sorted(err.failures.items()) if r != rank)
        print(
            f"distft: the run failed. Rank {rank} ended first ({how(first)})"
            + (f", then the others ({others})" if others else "")
            + ". The ranks' own messages, if they left any, are above.",
            file=sys.stderr,
        )
        return 1
    return 0


def _without_traceback(record: logging.LogRecord) -> bool:
    record.exc_info, record.exc_text = None, None
    return True


if __name__ == "__main__":
    sys.exit(main())
