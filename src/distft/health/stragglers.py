"""A rank that keeps the others waiting, step after step, named while the run goes on.

In a synchronous run every collective waits for the last rank to join it, so every rank's step
*time* grows alike when one rank is slow, and the slow rank's own is the shortest (it never waits).
What tells the slow rank apart is when each rank *arrives*. Before each step (its hooks run and its
batch drawn, just before its timing starts) every rank all-reduces one float per rank, its slot
holding how long it took to get there since all ranks left the previous step's all-reduce
together: a rank's "arrival time" for the step. The others' are what they needed; a straggler's is
longer by the time the others then wait for it. Every `train.straggler_window` steps each rank's
median arrival time is compared with the median of the other ranks' medians; a rank above
`train.straggler_ratio` (1.5) times that is named (`StragglerWindow`, pure).

What it sees: whatever a rank does alone between its step's last collective and the next step's
first (the optimizer step, logging, checkpoint writes, drawing the batch, a hook, a pause of the
host), and any slowness that is not hidden inside the step's own collectives. What it cannot see:
a rank slower only inside forward/backward (a throttled GPU under DDP or FSDP): the step's own
collectives absorb that, and every rank's step time grows alike (compare the run's MFU with a
healthy one's, or `distft doctor` per node).

The arrival times ride the one collective between steps, with the stop signal
(`distft.train.boundary`); this module only judges them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Finding:
    """A rank named for one window of steps."""

    rank: int
    ratio: float  # its median arrival time over the other ranks' median
    seconds: float  # its median arrival time
    others_s: float  # the other ranks' median
    first_step: int
    last_step: int


@dataclass
class StragglerWindow:
    """Every rank's arrival time per step, judged once every `window` steps (pure)."""

    window: int
    ratio: float = 1.5  # a rank's median arrival time over the others' median, above which it is named
    names: list[str] = field(default_factory=list)  # how each rank is named ("rank 3 (node 1, ...)")
    rows: list[tuple[int, list[float]]] = field(default_factory=list)  # (step, every rank's seconds)
    found: dict[int, dict] = field(default_factory=dict)  # rank -> {"ratio": worst, "steps": [[a, b], ...]}

    def add(self, step: int, seconds: list[float]) -> list[Finding]:
        """Record step `step`'s arrival times (by rank); the ranks named when a window completes."""
        self.rows.append((step, seconds))
        if len(self.rows) < self.window:
            return []
        rows, self.rows = self.rows, []
        medians = [statistics.median(times[r] for _, times in rows) for r in range(len(rows[0][1]))]
        findings = []
        for rank, median in enumerate(medians):
            others = statistics.median(medians[:rank] + medians[rank + 1 :])
            if others > 0 and median > self.ratio * others:
                findings.append(Finding(rank, median / others, median, others, rows[0][0], rows[-1][0]))
        for f in findings:
            self._remember(f)
        return findings

    def _remember(self, f: Finding) -> None:
        entry = self.found.setdefault(f.rank, {"ratio": 0.0, "steps": []})
        entry["ratio"] = round(max(entry["ratio"], f.ratio), 2)
        steps = entry["steps"]
        if steps and steps[-1][1] + 1 == f.first_step:
            steps[-1][1] = f.last_step  # windows in a row: one span
        else:
            steps.append([f.first_step, f.last_step])

    def message(self, f: Finding) -> str:
        name = self.names[f.rank] if f.rank < len(self.names) else f"rank {f.rank}"
        return (
            f"{name} is a straggler: over steps {f.first_step}-{f.last_step} it took {f.ratio:.1f}x the other "
            f"ranks' median to reach each step ({f.seconds:.3g} s against {f.others_s:.3g} s), and every "
            "collective waits for it. It is overloaded, or slower at the work it does alone (its data, its "
            "host, its disk); ranks.json keeps the steps."
        )
