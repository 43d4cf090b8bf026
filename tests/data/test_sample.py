"""The synthetic meetings (`sample`, bundled; `sample-long`, generated) are reproducible and
internally consistent."""

import hashlib
import json
import random
import re
import statistics

import pytest

from distft.config import DataConfig
from distft.data import SummaryRow, load_rows, validation_rows
from distft.data.cache import source_identity
from distft.data.sample import (
    LONG_SPLITS,
    SAMPLE_SPLITS,
    generate_meeting,
    is_sample,
    sample_path,
    write_sample_files,
)
from distft.data.sample_long import ATTRIBUTES, CHARS_PER_TOKEN, generate_long_meeting
from distft.io.lineage import _data_name


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


# ---- sample-long: whole meetings of 4.7k-28k tokens, written into the cache on first use ------------

# The generated set's bytes, pinned: byte-identical on every machine (sample_long's docstring says
# how). A deliberate change to either generator changes it: print the new digest and paste it here.
LONG_SHA256 = {
    "train": "d9ee5c982fa99415d367f76d904f6eba276a7ab784fd14c427b50852be2742e8",
    "validation": "2c5e85045a28e4f212905bf6190ab6e371fa10f0529598a47e54293aefc1fce0",
}
DECISION = re.compile(
    rf"we decide on (.+?) for the ({'|'.join(a.name for a in ATTRIBUTES)}) for (the .+)\.$", re.M
)


@pytest.fixture(scope="module")
def long_cache(tmp_path_factory):
    """The set, written once for the module into a fresh DISTFT_CACHE (set only meanwhile: the
    offline tokenizer stays in the usual cache); `"cache"`: that directory."""
    cache = tmp_path_factory.mktemp("distft-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DISTFT_CACHE", str(cache))
        return {"cache": cache, **{split: sample_path(split, "sample-long") for split in LONG_SPLITS}}


def _long_rows(paths, split):
    return [json.loads(line) for line in paths[split].read_text(encoding="utf-8").splitlines()]


def test_long_set_is_reproducible(long_cache, tmp_path):
    write_sample_files(tmp_path, "sample-long")
    for split in LONG_SPLITS:
        data = long_cache[split].read_bytes()
        assert (tmp_path / f"{split}.jsonl").read_bytes() == data
        assert hashlib.sha256(data).hexdigest() == LONG_SHA256[split], split
    a = generate_long_meeting(random.Random(7), "m")
    assert a == generate_long_meeting(random.Random(7), "m") != generate_long_meeting(random.Random(8), "m")


def test_long_meetings_fit_4k_to_32k_tokens(long_cache, tokenizer):
    """The shortest, the longest (by characters) and a few more, with the Qwen3 tokenizer: the
    transcript over 4k tokens, the whole example (prompt, transcript, summary) within 32k."""
    rows = _long_rows(long_cache, "train")
    assert len(rows) == LONG_SPLITS["train"][0] and len(_long_rows(long_cache, "validation")) == 8
    by_length = sorted(rows, key=lambda r: len(r["transcript"]))
    for row in [*by_length[:2], *by_length[-2:], *rows[:3]]:
        transcript, summary = (len(tokenizer(row[k])["input_ids"]) for k in ("transcript", "summary"))
        assert transcript >= 4000 and transcript + summary + 64 <= 32768, row["id"]  # 64: the prompt
        assert 100 <= summary <= 500, row["id"]  # a few hundred tokens
        assert abs(len(row["transcript"]) / transcript - CHARS_PER_TOKEN) < 0.3, row["id"]
    # Mostly AMI-sized (median 9-10k), a tail to 30k.
    assert 8000 < len(by_length[len(rows) // 2]["transcript"]) / CHARS_PER_TOKEN < 18000


def test_every_decision_is_in_the_summary_and_stated_once(long_cache):
    """Each agenda item is decided in one line of its own discussion, the decisions run through
    the whole meeting, and the summary names each, grouped by workstream."""
    for row in _long_rows(long_cache, "train") + _long_rows(long_cache, "validation"):
        transcript, summary = row["transcript"], row["summary"]
        assert all(re.match(r"^[A-Z][a-z]+: \S", line) for line in transcript.splitlines())
        n_items = int(re.search(r"we have (\d+) points", transcript).group(1))
        decisions = DECISION.findall(transcript)
        assert len(decisions) == transcript.count("decide on") == n_items and 8 <= n_items <= 40
        assert len({(attr, ws) for _, attr, ws in decisions}) == n_items  # every item once
        assert f"decided {n_items} points" in summary
        by_ws: dict[str, list[str]] = {}
        for value, attr, ws in decisions:
            by_ws.setdefault(ws, []).append(f"{value} for the {attr}")
            assert re.search(rf"^\w+: For {ws}, the .*\b{attr}\b", transcript, re.M), (ws, attr)  # the agenda
        for ws, decided in by_ws.items():
            sentence = re.search(rf"(?:^|\. ){re.escape(ws.capitalize())}: (.+?)\.(?: |$)", summary).group(1)
            assert all(d in sentence for d in decided) and sentence.count(" for the ") == len(decided)
        assert sum(s.count(" for the ") for s in re.findall(r": (.+?)\.(?: |$)", summary)) == n_items
        where = [m.start() / len(transcript) for m in DECISION.finditer(transcript)]
        assert where[0] < 0.25 and where[-1] > 0.9  # a partial read misses some
        for owner, task in re.findall(r"([A-Z][a-z]+) will (.+?) by ", summary):
            assert re.search(rf"^{owner}: .*I will {re.escape(task)}", transcript, re.M), (owner, task)


def test_sample_long_is_a_data_source(long_cache, monkeypatch):
    """`data.source = "sample-long"` (`--data sample-long`) reads through the row source, the
    token cache's key and the run's lineage like `sample`."""
    monkeypatch.setenv("DISTFT_CACHE", str(long_cache["cache"]))
    cfg = DataConfig(source="sample-long")
    splits = load_rows(cfg)
    assert (len(splits["train"]), len(splits["validation"])) == (64, 8)
    assert all(isinstance(r, SummaryRow) and len(r.transcript) > 15000 for r in splits["validation"])
    assert validation_rows(cfg, limit=2) == splits["validation"][:2]
    assert source_identity(cfg)["files"][0]["path"] == str(long_cache["train"].resolve())
    assert is_sample("sample-long") and not is_sample("sample-long.jsonl")
    assert "(--data sample-long)" in _data_name("sample-long")
