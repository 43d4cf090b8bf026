"""The token cache (`distft.data.cache`): built once and opened after, keyed by everything that
decides the tokens, never trusted half-written, shared by ranks, and invisible to training."""

from __future__ import annotations

import json
import os
import signal
import threading
import tracemalloc
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from distft.bench.startup import write_synthetic_rows
from distft.config import DataConfig
from distft.data import (
    IGNORE,
    ChatFormatter,
    collate,
    global_batch_indices,
    mean_label_tokens,
    open_or_build,
    pack,
    tokenized_splits,
)
from distft.data import cache as cache_module
from distft.data.cache import cache_key, cache_path
from distft.data.store import META
from distft.data.tokenizer import qwen3_tokenizer
from distft.errors import DataError
from distft.model.presets import MICRO_RANKS
from tests.helpers import distft, metrics

MEETING = {
    "transcript": "Anna: we pick yellow.\nTom: agreed, yellow it is.",
    "summary": "The team chose yellow.",
}


def meetings(path: Path, n: int, tag: str = "") -> Path:
    path.write_text("".join(json.dumps({**MEETING, "summary": f"Choice {i}{tag}."}) + "\n" for i in range(n)))
    return path


def same_examples(a, b) -> None:
    assert len(a) == len(b)
    assert [a[i] for i in range(len(a))] == [b[i] for i in range(len(b))]
    assert a.summary() == b.summary()


def test_a_second_run_opens_the_cache_without_reading_or_tokenising(tmp_path, tokenizer, monkeypatch):
    cfg = DataConfig(source=str(meetings(tmp_path / "m.jsonl", 30)), cache_dir=str(tmp_path / "c"))
    first = open_or_build(cfg, 0, tokenizer)
    assert first.state == "built" and first.path.parent == tmp_path / "c"

    def refuse(*args, **kwargs):
        raise AssertionError("a cache hit read or tokenised rows")

    monkeypatch.setattr(cache_module, "row_source", refuse)
    monkeypatch.setattr(ChatFormatter, "encode", refuse)
    monkeypatch.setattr(ChatFormatter, "encode_many", refuse)
    second = open_or_build(cfg, 0, tokenizer)
    assert second.state == "hit" and second.path == first.path
    same_examples(second.train, first.train)
    same_examples(second.validation, first.validation)


def test_the_key_follows_what_decides_the_tokens(tmp_path, tokenizer, monkeypatch):
    cfg = DataConfig(source=str(meetings(tmp_path / "m.jsonl", 10)), cache_dir=str(tmp_path / "c"))

    def path(c: DataConfig = cfg, seed: int = 0) -> Path:
        return cache_path(c, cache_key(c, seed, tokenizer))

    base = path()
    assert path(replace(cfg, max_length=512)) != base
    assert path(replace(cfg, enable_thinking=True)) != base
    assert path(replace(cfg, system_prompt="Be brief.")) != base
    assert path(seed=1) != base  # another held-out split
    assert path(replace(cfg, packing=False)) == base  # changes neither tokens nor split
    assert path(replace(cfg, cache_dir=str(tmp_path / "elsewhere"))).name == base.name
    meetings(tmp_path / "m.jsonl", 10, tag=" again")  # new content (and size)
    assert path() != base
    rewritten = path()
    monkeypatch.setattr(tokenizer, "chat_template", tokenizer.chat_template + " ")
    assert path() != rewritten


def test_a_crash_mid_build_leaves_no_cache_that_is_trusted(tmp_path, tokenizer, monkeypatch):
    cfg = DataConfig(source=str(meetings(tmp_path / "m.jsonl", 40)), cache_dir=str(tmp_path / "c"))
    final = cache_path(cfg, cache_key(cfg, 0, tokenizer))
    monkeypatch.setattr(cache_module, "ENCODE_CHUNK", 8)  # several chunks: die after the first
    pid = os.fork()
    if pid == 0:  # the child is killed mid-build, as by the OOM killer: no cleanup runs
        try:
            open_or_build(cfg, 0, tokenizer, progress=lambda n: os.kill(os.getpid(), signal.SIGKILL))
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    left = [p for p in final.parent.iterdir() if ".tmp-" in p.name]
    assert left and (left[0] / "tokens.bin").stat().st_size > 0  # half written, under a temporary name
    assert not final.exists()

    # An error (not a kill) cleans up after itself; the key still names nothing.
    def disk_full(*args):
        raise OSError("disk full")

    monkeypatch.setattr(cache_module, "_splits", disk_full)
    with pytest.raises(OSError, match="disk full"):
        open_or_build(cfg, 0, tokenizer)
    assert not final.exists() and not list(final.parent.glob(f".{final.name}.tmp-*-{os.getpid()}"))
    monkeypatch.undo()

    cache = open_or_build(cfg, 0, tokenizer)
    assert cache.state == "built" and not [p for p in final.parent.iterdir() if ".tmp-" in p.name]
    (final / "tokens.bin").write_bytes(b"\0" * 3)  # damaged after the fact: refused, not read
    with pytest.raises(DataError, match="damaged"):
        open_or_build(cfg, 0, tokenizer)
    with pytest.raises(DataError, match="Cannot write the token cache"):  # a file where a directory goes
        open_or_build(replace(cfg, cache_dir=str(tmp_path / "m.jsonl" / "c")), 0, tokenizer)


def test_processes_that_race_for_a_missing_cache_build_it_once(tmp_path, tokenizer, monkeypatch):
    cfg = DataConfig(source=str(meetings(tmp_path / "m.jsonl", 30)), cache_dir=str(tmp_path / "c"))
    builds, build = [], cache_module.build_store
    monkeypatch.setattr(cache_module, "build_store", lambda *a: (builds.append(1), build(*a)))
    results = [None, None]

    def rank(i: int) -> None:  # each opens the lock file itself, as another process would
        results[i] = open_or_build(cfg, 0, tokenizer)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and sorted(r.state for r in results) == ["built", "hit"]
    assert results[0].path == results[1].path


def _parquet(path: Path) -> Path:
    pq.write_table(pa.Table.from_pylist([{**MEETING, "summary": f"P{i}."} for i in range(25)]), path)
    return path


@pytest.mark.parametrize(
    ("source", "settings"),
    [
        ("sample", {"max_length": 384}),
        ("jsonl", {"max_rows": 7}),  # max_rows: a first pass counts, then only the used rows are tokenised
        ("parquet", {"validation_fraction": 0.2}),
    ],
)
def test_the_cache_gives_the_batches_memory_gives(tmp_path, tokenizer, source, settings):
    paths = {
        "jsonl": lambda: str(meetings(tmp_path / "m.jsonl", 40)),
        "parquet": lambda: str(_parquet(tmp_path / "m.parquet")),
    }
    cfg = DataConfig(
        source=paths[source]() if source in paths else source, cache_dir=str(tmp_path / "c"), **settings
    )
    cached = tokenized_splits(cfg, 3, tokenizer)
    memory = tokenized_splits(replace(cfg, cache=False), 3, tokenizer)
    assert cached[2]["state"] == "built" and memory[2]["state"] == "memory"
    for got, want in zip(cached[:2], memory[:2], strict=True):
        same_examples(got, want)
    train, reference = cached[0], memory[0]
    # The labelled positions per row, which a pipeline cuts its stages by: alike, and not counted
    # as reads (ranks.json's examples_read counts the batches').
    reads = train.reads
    labelled = [sum(t != IGNORE for t in e.labels) for e in reference.examples]
    assert [train.label_count(i) for i in range(len(train))] == labelled
    assert mean_label_tokens(train) == mean_label_tokens(reference) > 0 and train.reads == reads
    for step in range(3):
        idx = global_batch_indices(step, len(train), 4, seed=3)
        for layout in (collate, pack):
            got, want = layout([train[i] for i in idx], 0), layout([reference[i] for i in idx], 0)
            assert all(got[k].equal(want[k]) for k in want)


@pytest.mark.parametrize("has_validation", [True, False])
def test_a_streamed_hub_set_is_tokenised_into_the_cache(tmp_path, tokenizer, monkeypatch, has_validation):
    """No network here: the hub's `load_dataset` is `datasets`' own JSON loader on local files,
    streamed (an IterableDataset) when asked to stream."""
    import datasets

    files = {"train": meetings(tmp_path / "train.jsonl", 30)}
    if has_validation:
        files["validation"] = meetings(tmp_path / "validation.jsonl", 6, tag=" held out")
    calls, load = [], datasets.load_dataset

    def hub(dataset_id, split, streaming=False, revision=None):
        calls.append((dataset_id, split, streaming, revision))
        if split not in files:
            raise ValueError(f'Unknown split "{split}"')
        return load("json", data_files={split: str(files[split])}, split=split, streaming=streaming)

    monkeypatch.setattr(datasets, "load_dataset", hub)
    cfg = DataConfig(source="org/meetings", streaming=True, revision="v1", cache_dir=str(tmp_path / "c"))
    streamed = tokenized_splits(cfg, 0, tokenizer)
    assert streamed[2]["state"] == "built"
    assert calls and all(streaming and revision == "v1" for _, _, streaming, revision in calls)
    downloaded = tokenized_splits(replace(cfg, streaming=False, cache=False), 0, tokenizer)
    for got, want in zip(streamed[:2], downloaded[:2], strict=True):
        same_examples(got, want)
    assert len(streamed[1]) == (6 if has_validation else 3)
    calls.clear()
    assert tokenized_splits(cfg, 0, tokenizer)[2]["state"] == "hit" and not calls  # no stream opened


def test_100k_rows_two_ranks_share_one_cache_and_read_only_their_batches(tmp_path, tokenizer):
    """The CLI tokenises 100k rows once, before launch; both ranks open that store, reach step 1
    and read only their batches' examples. Opening it allocates nothing that grows with the rows."""
    data = write_synthetic_rows(tmp_path / "rows.jsonl", 100_000)
    cache_dir = tmp_path / "cache"
    proc = distft(
        "train", "--strategy", "ddp", "--nproc", "2", "--model", "micro", "--data", str(data),
        "--max-steps", "1", "--out", str(tmp_path / "run"), "train.global_batch_size=4",
        "train.micro_batch_size=1", "train.eval_batches=1", "data.max_length=128", f"data.cache_dir={cache_dir}",
    )  # fmt: skip
    assert "tokenised 100,000 examples" in proc.stdout
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1]
    stores = [p for p in cache_dir.iterdir() if not p.name.startswith(".")]
    assert len(stores) == 1 and json.loads((stores[0] / META).read_text())["examples"] == 100_000
    ranks = json.loads((tmp_path / "run" / "ranks.json").read_text())
    assert [(r["token_cache"]["state"], r["token_cache"]["path"]) for r in ranks] == [
        ("hit", str(stores[0]))
    ] * 2
    assert all(r["token_cache"]["examples_read"] <= 8 for r in ranks)  # step 1's batch and one eval batch

    cfg = DataConfig(source=str(data), max_length=128, cache_dir=str(cache_dir))
    tracemalloc.start()
    cache = open_or_build(cfg, 0, qwen3_tokenizer(MICRO_RANKS))  # what each rank did, in this process
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert cache.state == "hit" and len(cache.train) + len(cache.validation) == 100_000
    assert peak < 1_000_000, peak  # the store is ~30 MB; opening maps it and reads none of it
