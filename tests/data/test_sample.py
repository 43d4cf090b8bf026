"""The bundled meetings are reproducible and internally consistent."""

import json
import random
import re
import statistics

from distft.data.sample import SAMPLE_SPLITS, generate_meeting, sample_path, write_sample_files


def _rows(split):
    return [json.loads(line) for line in sample_path(split).read_text(encoding="utf-8").splitlines()]


def test_bundle_is_reproducible(tmp_path):
    write_sample_files(tmp_path)
    for split in SAMPLE_SPLITS:
        assert (tmp_path / f"{split}.jsonl").read_bytes() == sample_path(split).read_bytes()


def test_generator_is_deterministic():
    a = generate_meeting(random.Random(7), "m")
    assert a == generate_meeting(random.Random(7), "m")
    assert a != generate_meeting(random.Random(8), "m")


def test_rows_are_complete_and_splits_disjoint():
    train, val = _rows("train"), _rows("validation")
    assert (len(train), len(val)) == (SAMPLE_SPLITS["train"][0], SAMPLE_SPLITS["validation"][0])
    for row in train + val:
        assert row["transcript"].strip() and row["summary"].strip()
        assert all(re.match(r"^[A-Z][a-z]+: ", line) for line in row["transcript"].splitlines())
    ids = [r["id"] for r in train + val]
    assert len(set(ids)) == len(ids)
    assert not {r["transcript"] for r in train} & {r["transcript"] for r in val}


def test_summary_facts_come_from_the_transcript():
    for row in _rows("train")[:100]:
        transcript, summary = row["transcript"], row["summary"]
        for owner, task in re.findall(r"([A-Z][a-z]+) will (.+?) by ", summary):
            assert re.search(rf"^{owner}: .*I will {re.escape(task)}", transcript, re.M), (owner, task)
        agreed = re.search(r"agreed on (.+?)\. ", summary).group(1)
        for decision in re.split(r", | and (?=\S+ .* for )", agreed):
            value = decision.split(" for ")[0]
            assert f"decide on {value}" in transcript, value


def test_lengths():
    words = [len(r["transcript"].split()) for r in _rows("train")]
    summaries = [len(r["summary"].split()) for r in _rows("train")]
    assert 150 <= statistics.median(words) <= 450
    long = sum(w > 600 for w in words)
    assert 0.03 * len(words) < long < 0.2 * len(words)  # some meetings exercise truncation
    assert min(summaries) >= 25 and max(summaries) <= 100
