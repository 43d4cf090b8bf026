"""torchrun for distft: the ranks of a multi-process run, and a failure reported in one paragraph.

`launch_ranks` starts `distft ARGV` once per rank under torchrun's elastic agent: --nproc processes
on this node, which meet the other nodes' at --rdzv-endpoint (node 0's HOST:PORT) when --nnodes is
above 1. Every rank then finds RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK and LOCAL_WORLD_SIZE in its
environment (`distributed.init_distributed`).

Two ways to start a rank:
- exec (CUDA): `python -m distft.launch ARGS` is torchrun itself (same arguments) and each rank a
  fresh `python -m distft.cli`. A process must not fork once it has touched CUDA, and importing the
  stack may (torchao probes the device's capability).
- fork (CPU): the agent runs in the calling process, which has imported torch, transformers and
  peft already, and each rank is forked from it and runs `distft.cli` as `-m` would. A fresh
  Python spends ~5 s of CPU on those imports, and N ranks pay it N times on the same cores.
  A restart (`--max-restarts`) forks again from the same process, which never trains.
  Forking a process with threads is safe only while no other thread holds a lock the child
  will need. The agent's threads are its store's server and the rendezvous keep-alive; the
  ranks get a store of their own (below), so those threads have nothing to do with them.
  OpenMP's pool is kept out of it: the launching process computes on one thread, each rank on
  torchrun's count (`one_thread_before_forking`).

When ranks fail for good (after `--max-restarts` restarts), torchrun itself raises
`ChildFailedError`, printing a Python traceback of the agent under the ranks' own messages; here
the failure is summarised instead (which rank, its exit code or signal) and the exit code is 1.
The ranks' own output, including their error paragraphs, is untouched.

Restarts need the rendezvous store unshared. By default torchrun's agent keeps one TCPStore for
all attempts and the ranks build their process group in it without a per-attempt prefix, so a
restarted rank can read a key its dead predecessor wrote (gloo: "connectFullMesh failed ...
Connection refused" to the dead rank's old port; NCCL: a stale unique id): one of the first two
killed-rank runs here. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each attempt a fresh store
(pytorch/pytorch#135712); with it, every killed-rank run here has restarted cleanly. Forked
ranks always have it: with the agent's store shared, its thread served rank 0 while rank 7 was
forked and left rank 7 a glibc resolver lock held forever (it hung in getaddrinfo; 1 run in 3 of
8 ranks under load, none in 25 since).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import runpy
import signal
import subprocess
import sys
import uuid
import warnings
from collections.abc import Iterator

import psutil
import torch

from distft import signals
from distft.config import ParallelConfig
from distft.exits import FORKED_ENV

UNSHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # the ranks' store is rank 0's, not the agent's


_rank_threads = 0  # the launching process's threads before `one_thread_before_forking`: the ranks'


def one_thread_before_forking() -> None:
    """This process computes on one thread from now on: a command that will fork its ranks calls it
    before its checks (which read, tokenise and shuffle the rows; it never trains). libgomp, torch's
    OpenMP on Linux, is not fork-safe: a pool of threads started here would be copied into every
    forked rank without its threads, and the rank's first operation to go parallel would wait for
    them forever (a 2-rank run with `data.cache=false` on 100,000 rows hung so, in the `randperm`
    that splits them). The ranks set their own count (`run_module`)."""
    global _rank_threads
    _rank_threads = _rank_threads or torch.get_num_threads()
    torch.set_num_threads(1)


def launch_ranks(p: ParallelConfig, argv: list[str], fork: bool) -> int:
    """`distft ARGV` once per rank; the exit code of the whole run. `fork`: CPU runs (see above)."""
    args = [*torchrun_args(p), "-m", "distft.cli", *argv]
    if fork:
        one_thread_before_forking()  # already, where the caller computed before (`distft train`)
        return main(args, fork=True)
    launcher = subprocess.Popen([sys.executable, "-m", "distft.launch", *args])
    # SIGINT/SIGTERM go on to the launcher (its agent to the ranks), which decides the exit code.
    relay = signals.forward_to(lambda: [launcher.pid])
    with signals.handling(first=relay, later=relay):
        return launcher.wait()


def torchrun_args(p: ParallelConfig) -> list[str]:
    """torchrun's placement flags for a run laid out by `p`."""
    # --shutdown-timeout: how long ranks told to stop (SIGINT, SIGTERM) get to checkpoint before
    # SIGKILL, as long as any of their collectives may wait (torchrun's default: 30 s).
    args = [
        f"--nproc-per-node={p.nproc}",
        f"--max-restarts={p.max_restarts}",
        f"--shutdown-timeout={p.timeout_s}",
    ]
    if p.nnodes == 1:
        return [*args, "--standalone"]  # a free port on this machine
    host, _, port = p.rdzv_endpoint.rpartition(":")
    return [
        *args,
        f"--nnodes={p.nnodes}",
        f"--node-rank={p.node_rank}",
        f"--master-addr={host}",
        f"--master-port={port}",
    ]


def main(argv: list[str] | None = None, fork: bool = False) -> int:
    """torchrun ARGV in this process; with `fork`, each rank is forked from it (`-m` scripts only)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.max_restarts:
        os.environ.setdefault(UNSHARED_STORE, "1")
    # SIGINT and SIGTERM are `distft.signals`' (below), torch's handler keeps the other two.
    args.signals_to_handle = "SIGHUP,SIGQUIT"
    try:
        with _stopping_ranks(), _without_rendezvous_skew(args.standalone):
            if not fork:
                run(args)
                return 0
            if args.standalone:  # what torch.distributed.run.run does before it launches
                args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
            args.start_method = "fork"
            config, _, _ = config_from_args(args)
            with _forking():
                elastic_launch(config, run_module)(args.training_script, list(args.training_script_args))
    except ChildFailedError as err:
        print(_summary(err), file=sys.stderr)
        return 1
    except SignalException as err:  # the ranks stopped (the main rank said where) or were killed
        return signals.exit_code(err.sigval)
    return 0


def run_module(module: str, argv: list[str]) -> None:
    """One forked rank: `python -m MODULE ARGV`, with MODULE's imports already done. It returns on
    success: the agent waits for each rank's return value, which a `SystemExit(0)` would skip."""
    sys.argv = [module, *argv]
    # An exec'd rank's threads: torchrun's OMP_NUM_THREADS (1 where several ranks share a node),
    # which OpenMP reads only as a process starts, else the machine's default.
    torch.set_num_threads(
        int(os.environ.get("OMP_NUM_THREADS") or 0) or _rank_threads or torch.get_num_threads()
    )
    # The module ran its imports in the agent (`distft` itself runs `distft.cli`, which imported the
    # command's module: `COMMANDS`); running it again as __main__ is the point, and runpy's warning
    # that it is already imported is noise.
    warnings.filterwarnings("ignore", f"'{module}' found in sys.modules", RuntimeWarning)
    try:
        with signals.handling():  # not the agent's handler, inherited by the fork (`distft.signals`)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code:
            raise
    except signals.Interrupted as stop:  # before the module took the signals over
        raise SystemExit(signals.exit_code(stop.signum)) from None


@contextlib.contextmanager
def _forking() -> Iterator[None]:
    """What the ranks forked from this process need, undone after them."""
    saved = dict(os.environ)
    os.environ[FORKED_ENV] = "1"  # `exit_worker` returns instead of `os._exit`: multiprocessing exits
    # The checks before launch tokenised on the tokenizers library's threads, which a fork does not
    # copy: it would warn in every rank that touches a tokenizer, then go on single-threaded anyway.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The ranks' store is rank 0's, so the agent's store thread never works while a rank is forked.
    os.environ.setdefault(UNSHARED_STORE, "1")
    # Objects frozen out of the collector are never traversed in the ranks, so their pages (the
    # imported modules, the tokenizer loaded for the checks) stay shared instead of being copied.
    # The young generations go first (the checks' garbage); a full collection would walk every
    # imported object for ~0.2 s of every launch, and finds nothing there to free.
    gc.collect(1)
    gc.freeze()
    # A failed forked rank is logged with the traceback of the agent's own wait for it (an exec'd
    # one without): the rank's message and the summary say it all.
    log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    log.addFilter(_without_traceback)
    try:
        yield
    finally:
        log.removeFilter(_without_traceback)
        gc.unfreeze()
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _without_rendezvous_skew(one_node: bool) -> Iterator[None]:
    """torchrun's c10d rendezvous begins with a random 0-0.3 s sleep, which spreads the nodes'
    first requests to the store; a run on one node has no other to spread from."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    delay = getattr(dynamic_rendezvous, "_delay", None)
    if not one_node or delay is None:
        yield
        return
    # A (low, high) range is that first skew; a plain number (polling the store) still sleeps.
    dynamic_rendezvous._delay = lambda seconds: None if isinstance(seconds, tuple) else delay(seconds)
    try:
        yield
    finally:
        dynamic_rendezvous._delay = delay


@contextlib.contextmanager
def _stopping_ranks() -> Iterator[None]:
    """SIGINT/SIGTERM in the agent: the first raises torch's `SignalException`, on which the agent
    sends the same signal to its ranks and gives them `--shutdown-timeout` seconds to stop at a step
    boundary and checkpoint; a second (`distft.signals`) goes on to the ranks, which then leave at
    once. The agent's own lines about it are left out: the main rank says what happened."""
    from torch.distributed.elastic.multiprocessing import SignalException

    def stop(signum: int) -> None:
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    def children() -> list[int]:
        return [child.pid for child in psutil.Process().children()]

    logs = [
        logging.getLogger(f"torch.distributed.elastic.{m}.api") for m in ("agent.server", "multiprocessing")
    ]
    for log in logs:
        log.addFilter(_without_stop_notes)
    try:
        with signals.handling(first=stop, later=signals.forward_to(children)):
            yield
    finally:
        for log in logs:
            log.removeFilter(_without_stop_notes)


_STOP_NOTES = (
    "Received %s death signal",
    "Closing process %s via signal",
    "Sending process %s closing signal",
)


def _without_stop_notes(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_STOP_NOTES)


def _summary(err) -> str:
    def how(failure) -> str:
        return f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"

    rank, first = err.get_first_failure()
    others = "; ".join(f"rank {r}: {how(f)}" for r, f in sorted(err.failures.items()) if r != rank)
    return (
        f"distft: the run failed. Rank {rank} ended first ({how(first)})"
        + (f", then the others ({others})" if others else "")
        + ". The ranks' own messages, if they left any, are above."
    )


def _without_traceback(record: logging.LogRecord) -> bool:
    record.exc_info, record.exc_text = None, None
    return True


if __name__ == "__main__":
    sys.exit(main())
