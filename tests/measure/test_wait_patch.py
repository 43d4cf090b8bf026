"""torch's `Work.wait` is patched by `distft.measure.overlap.time_work_waits` only: importing distft
leaves torch as it is, and measuring patches it once. It runs in a fresh interpreter, since a
process that has measured a step (any test here that trained) has the patch for good."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_python(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_importing_distft_leaves_work_wait_untouched_and_a_timeline_patches_it_once():
    out = run_python(
        """
        import torch.distributed as dist
        Work = dist.distributed_c10d.Work
        original = Work.wait
        import distft.cli, distft.measure.overlap, distft.measure.step, distft.train
        from distft.measure import overlap
        print(Work.wait is original)
        with overlap.CommTimeline():
            patched = Work.wait
        overlap.time_work_waits()  # again: still the one wrapper around torch's own
        print(patched is overlap._timed_wait, Work.wait is patched, overlap._work_wait is original)
        """
    )
    assert out.split() == ["True", "True", "True", "True"]
