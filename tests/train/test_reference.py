"""The reference scored before step 1 (`distft.train.reference`): only the pairs the run reads, and
a resumed run that would read a pair never scored is refused, not trained on NaN. (A run that
scores, with its bar: tests/train/test_progress.py; every strategy: tests/parallel/test_preference.py.)"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from distft.config import load_config
from distft.data.batches import global_batch_indices
from distft.data.pairs import PairSplit
from distft.errors import TrainingError
from distft.train.progress import TrainingProgress
from distft.train.reference import REFERENCE_FILE, attach_reference, pairs_read


def fake_run(tmp_path, *settings: str, start_step: int = 0) -> SimpleNamespace:
    cfg = load_config(
        None,
        ["train.objective=dpo", "dpo.precompute_reference=true", "train.global_batch_size=4", *settings],
    )
    splits = PairSplit([object()] * 50), PairSplit([object()] * 10)
    return SimpleNamespace(
        cfg=cfg, train_set=splits[0], val_set=splits[1], out=tmp_path, start_step=start_step
    )


def test_the_pairs_read_are_the_steps_and_the_validation_batches(tmp_path):
    run = fake_run(tmp_path, "train.max_steps=3", "train.eval_batches=2")
    steps = {i for s in range(3) for i in global_batch_indices(s, 50, 4, run.cfg.train.seed)}
    assert pairs_read(run) == {"train": sorted(steps), "validation": range(8)} and len(steps) == 12
    assert pairs_read(fake_run(tmp_path, "train.max_steps=13", "train.eval_batches=0")) == {
        "train": range(50),  # 52 reads of 50 pairs: every one
        "validation": range(0),
    }


def test_a_resume_that_reads_pairs_never_scored_is_refused(tmp_path):
    run = fake_run(tmp_path, "train.max_steps=3", "train.eval_batches=2", start_step=1)
    read = pairs_read(run)
    scores = {
        name: torch.full((len(split), 2), math.nan)
        for name, split in (("train", run.train_set), ("validation", run.val_set))
    }
    for name, rows in read.items():
        scores[name][list(rows)] = -1.0
    save_file(scores, tmp_path / REFERENCE_FILE)
    progress = TrainingProgress(enabled=False, total_steps=3)
    attach_reference(run, progress)  # the same steps: every pair it reads has its score
    assert run.train_set.reference[read["train"][0]] == (-1.0, -1.0)
    run.cfg.train.max_steps = 6  # extended past what was scored
    with pytest.raises(TrainingError, match=r"reads train pairs it did not score: a larger train\.max_steps"):
        attach_reference(run, progress)
