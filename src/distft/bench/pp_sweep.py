"""The pipeline sweep's cells: which cut of the layers each run uses (`--pp-splits`), what a run
is named, and which of its figures the report reads.

`distft bench --pp-sweep` runs `pp` once per schedule x micro-batch count x split. A split is
`parallel.pp_split` (`distft.parallel.pipeline.cost`): `balanced` (the stages' modelled costs
evened out: the head makes the last stage heavier than its layers), `even` (layers by count), or
an explicit count of decoder layers per stage spelled `3-1` on the command line (`[3, 1]` in the
config). Splits are kept as those strings (in the settings and in results.json) and turned into
the override only when a run starts (`split_override`).
"""

from __future__ import annotations

from distft.commands.bench import DEFAULT_SPLITS
from distft.errors import ConfigError
from distft.parallel.pipeline import SCHEDULES

NAMED_SPLITS = ("balanced", "even")
# Per run figures of the steps' metrics records: their median over the measured steps.
STEP_FIGURES = ("idle_fraction", "idle_fraction_theory", "idle_fraction_modelled", "stage_imbalance",
                "stage_imbalance_modelled")  # fmt: skip


def parse_split(text: str) -> str:
    """One split as the command line gives it, checked: `balanced`, `even` or `N-N-...` (N >= 1)."""
    if text in NAMED_SPLITS:
        return text
    parts = text.split("-")
    if not all(p.isdigit() and int(p) >= 1 for p in parts) or len(parts) < 2:
        raise ConfigError(
            f"--pp-splits: {text!r} is not a split; give balanced, even, or decoder layers per stage joined "
            "by '-' (e.g. 3-1: three layers on stage 0, one on stage 1)."
        )
    return "-".join(str(int(p)) for p in parts)


def parse_splits(text: str) -> list[str]:
    """`--pp-splits`: comma-separated splits, each once, in the order given."""
    splits = [parse_split(s.strip()) for s in text.split(",") if s.strip()]
    if not splits:
        raise ConfigError(f"--pp-splits needs at least one split (e.g. {DEFAULT_SPLITS}), got {text!r}.")
    return list(dict.fromkeys(splits))


def split_override(split: str) -> str:
    """The `distft train` override that makes a run use `split`: 3-1 becomes a TOML list."""
    value = split if split in NAMED_SPLITS else "[" + split.replace("-", ",") + "]"
    return f"parallel.pp_split={value}"


def check_split_stages(splits: list[str], schedules: list[str], ranks: int, overrides: list[str]) -> None:
    """Refuse, before anything runs, an explicit split whose stage count some schedule of the sweep
    does not have (p x V stages; V is 2 for interleaved-1f1b and zbv). With a
    `parallel.stages_per_rank` override V is the run's to check."""
    if any(o.startswith("parallel.stages_per_rank=") for o in overrides):
        return
    for split in splits:
        if split in NAMED_SPLITS:
            continue
        stages = len(split.split("-"))
        wrong = [s for s in schedules if ranks * SCHEDULES[s][1] != stages]
        if wrong:
            have = ", ".join(f"{s} {ranks * SCHEDULES[s][1]}" for s in wrong)
            raise ConfigError(
                f"--pp-splits {split} cuts {stages} stages, but on {ranks} ranks these schedules have "
                f"another count ({have}); sweep them with balanced/even, or give them their own run."
            )


def run_name(schedule: str, microbatches: int, split: str | None) -> str:
    """A sweep run's name: its folder under runs/ and its key in the loss agreement. Runs recorded
    before splits existed have none."""
    return f"pp-{schedule}-m{microbatches}" + (f"-{split}" if split else "")


def sweep_entry(
    cell: tuple[str, int, str], step_time_s: dict, losses: list[float], figures: dict, timeline: dict
) -> dict:
    """One cell of results.json's `pp_sweep`: the run's (schedule, micro-batches, split), its step
    time spread and losses, the medians of its step figures (`figures`: the `extra` of its
    `harness.StrategyResult`), the cut it used and its last step's timeline
    (`pipeline_timeline.json`, kept whole for the Gantt charts)."""
    schedule, microbatches, split = cell
    return {
        "schedule": schedule,
        "microbatches": microbatches,
        "split": split,
        "layers_per_stage": timeline.get("layers_per_stage"),
        "step_time_s": step_time_s,
        "losses": losses,
        **{key: figures.get(key) for key in STEP_FIGURES},
        "idle_fraction_replayed": timeline.get("idle_fraction_replayed"),
        "idle_fraction_imbalance_floor": timeline.get("idle_fraction_imbalance_floor"),
        "timeline": timeline,
    }


def sweep_losses(sweep: list[dict]) -> dict[str, list[float]]:
    return {run_name(s["schedule"], s["microbatches"], s.get("split")): s["losses"] for s in sweep}
