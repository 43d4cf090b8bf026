"""The pipeline sweep's report section, rendered from a hand-built summary: nothing runs."""

import shlex
from dataclasses import asdict
from pathlib import Path

from distft.bench.harness import BenchSettings
from distft.bench.pp_report import pipeline_section
from distft.cli import build_parser
from tests.bench.fabricated import sweep_run

OUT = Path("runs/reports/pp")
SETTINGS = BenchSettings(
    strategies=["pp"], model="micro", steps=2, warmup=1, global_batch_size=4, micro_batch_size=1, seq_len=256,
    overrides=["data.max_rows=32"], pp_schedules=["gpipe", "1f1b", "zbv"], pp_microbatches=[2, 4],
)  # fmt: skip
SWEEP = [
    # 1f1b at m = 2: the balanced run is faster beyond the spread, and its idle 15 points off the model.
    sweep_run("1f1b", 2, "even", [2, 2], idle=(0.46, 0.45), step=(2.0, 1.9, 2.1), imbalance=(1.62, 1.55)),
    sweep_run("1f1b", 2, "balanced", [3, 1], idle=(0.40, 0.25), step=(1.5, 1.4, 1.6), imbalance=(1.31, 1.12)),
    # 1f1b at m = 4: the ranges overlap; idle 8 points off the model (within 10).
    sweep_run("1f1b", 4, "even", [2, 2], idle=(0.44, 0.40), step=(1.8, 1.7, 2.0)),
    sweep_run("1f1b", 4, "balanced", [3, 1], idle=(0.38, 0.30), step=(1.9, 1.8, 2.2)),
    # gpipe: the balanced run's fastest step is slower than the even run's slowest.
    sweep_run("gpipe", 2, "even", [2, 2], idle=(0.47, 0.45), step=(1.0, 0.9, 1.1)),
    sweep_run("gpipe", 2, "balanced", [3, 1], idle=(0.41, 0.33), step=(1.5, 1.3, 1.6)),
    # zbv: four stages of four layers, one each, whatever the split.
    sweep_run("zbv", 2, "even", [1, 1, 1, 1], idle=(0.46, 0.40), step=(2.5, 2.4, 2.6)),
    sweep_run("zbv", 2, "balanced", [1, 1, 1, 1], idle=(0.45, 0.40), step=(2.5, 2.4, 2.7)),
]


def _section(sweep: list[dict] = SWEEP) -> str:
    return "\n".join(pipeline_section({"settings": asdict(SETTINGS), "pp_sweep": sweep}, OUT))


def test_each_row_gives_the_cut_the_model_and_the_verdicts():
    text = _section()
    assert (
        "| schedule | m | split | layers per stage | step time (s, median [min-max]) | idle measured | idle modelled "
        "| idle theory | imbalance floor | replayed | stage imbalance measured | stage imbalance modelled "
        "| idle within 10 pp of modelled | step time vs even |"
    ) in text
    rows = [
        "| 1f1b | 2 | even | 2/2 | 2.000 [1.900-2.100] | 46% | 45% | 33% | 41% | 44% | 1.62 | 1.55 | yes | - |",
        "| 1f1b | 2 | balanced | 3/1 | 1.500 [1.400-1.600] | 40% | 25% | 33% | 35% | 38% | 1.31 | 1.12 | no "
        "| yes: faster |",
        "| 1f1b | 4 | balanced | 3/1 | 1.900 [1.800-2.200] | 38% | 30% | 20% | 33% | 36% | 1.50 | 1.40 | yes "
        "| yes: within the spread |",
        "| gpipe | 2 | balanced | 3/1 | 1.500 [1.300-1.600] | 41% | 33% | 33% | 36% | 39% | 1.50 | 1.40 | yes "
        "| no: slower |",
    ]
    for row in rows:
        assert row in text, row
    # How the verdicts are judged is said above the table, with the count of the idle one.
    assert "|measured - modelled| <= 10% (7 of 8 runs)" in text
    assert "min-max ranges" in text and text.index("min-max ranges") < text.index("| schedule |")


def test_a_paragraph_gives_even_to_balanced_per_schedule():
    text = _section()
    assert (
        "- **1f1b** (layers 2/2 -> 3/1): idle measured 46% -> 40% at m = 2, 44% -> 38% at m = 4; "
        "modelled 45% -> 25% at m = 2, 40% -> 30% at m = 4."
    ) in text
    assert (
        "- **gpipe** (layers 2/2 -> 3/1): idle measured 47% -> 41% at m = 2; modelled 45% -> 33% at m = 2."
        in text
    )
    assert "- **zbv** (layers 1/1/1/1 -> 1/1/1/1; the same cut: the runs differ by noise alone)" in text


def test_a_gantt_chart_per_schedule_and_split_with_the_command_that_draws_it():
    text = _section()
    lines = text.splitlines()
    for schedule in ("1f1b", "gpipe", "zbv"):
        for split in ("even", "balanced"):
            image = f"![{schedule} timeline, {split} cut](pp_gantt_{schedule}_{split}.png)"
            assert image in lines, image
            command = lines[lines.index(image) + 3]  # a blank line, ```bash, the command
            assert command.startswith("distft bench --strategies pp ")
            # The command, read back by distft's own parser, is this cell of the sweep alone.
            args = build_parser().parse_args(shlex.split(command)[1:])
            assert (args.pp_sweep, args.pp_microbatches, args.pp_splits) == (schedule, "2", split)
            assert (args.model, args.seq_len, args.global_batch) == ("micro", 256, 4)
            assert args.out == str(OUT / "cells" / f"pp-{schedule}-m2-{split}")  # the sweep's report stays
            assert args.overrides == ["data.max_rows=32"]
    assert "--pp-microbatches 4 " not in text  # each chart shows its schedule's smallest m
    assert (
        "The sweep, every setting spelled out: `distft bench --strategies pp --nproc 2 --model micro --steps 2 "
        "--warmup 1 --global-batch 4 --micro-batch 1 --seq-len 256 --pp-sweep gpipe,1f1b,zbv --pp-microbatches 2,4 "
        "--pp-splits balanced,even --out runs/reports/pp data.max_rows=32`."
    ) in text


def test_a_split_given_by_hand_is_judged_against_even_and_a_lone_one_is_not():
    by_hand = sweep_run("1f1b", 2, "1-3", [1, 3], idle=(0.6, 0.5), step=(3.0, 2.9, 3.1))
    text = _section([*SWEEP[:2], by_hand])
    assert "| 1f1b | 2 | 1-3 | 1/3 | 3.000 [2.900-3.100] | 60% | 50% |" in text
    assert "![1f1b timeline, 1-3 cut](pp_gantt_1f1b_1-3.png)" in text
    assert "| 1.50 | 1.40 | yes | no: slower |" in text
    alone = _section([SWEEP[1]])  # no even run to compare with, and no paragraph
    assert "| yes: faster |" not in alone and "- (no even run) |" in alone
    assert "Even -> balanced" not in alone
