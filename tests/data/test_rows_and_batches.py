import json
import tracemalloc

import pytest

from distft.config import DataConfig
from distft.data import (
    IGNORE,
    ChatFormatter,
    SummaryRow,
    collate,
    count_label_tokens,
    global_batch_indices,
    load_rows,
    rank_micro_batches,
    row_from_record,
    validation_rows,
)
from distft.errors import DataError


def formatter(tokenizer, **overrides):
    return ChatFormatter(tokenizer, DataConfig(**overrides))


@pytest.mark.parametrize(
    "record",
    [
        {"id": "1", "dialogue": "A: hi\nB: hello", "summary": "They greet."},  # knkarthick/AMI
        {"input": "A: hi\nB: hello", "output": "They greet."},  # qmsum-cleaned
        {
            "meeting_transcripts": [{"speaker": "A", "content": "hi"}, {"speaker": "B", "content": "hello"}],
            "general_query_list": [{"query": "Summarize the whole meeting.", "answer": "They greet."}],
        },  # QMSum
    ],
)
def test_known_schemas(record):
    row = row_from_record(record, DataConfig(), "x:1")
    assert row.transcript == "A: hi\nB: hello"
    assert row.summary == "They greet."


def test_configured_fields():
    row = row_from_record(
        {"text": "A: hi", "abstract": "Hi."},
        DataConfig(transcript_field="text", summary_field="abstract"),
        "x:1",
    )
    assert (row.transcript, row.summary) == ("A: hi", "Hi.")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"transcript": "A: hi", "summary": ', "not valid JSON"),
        ('{"transcript": "A: hi"}', "missing field `summary`"),
        ('{"body": "A: hi"}', "no transcript/summary fields"),
        ('{"transcript": "A: hi", "summary": "  "}', "field `summary` is empty"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "meetings.jsonl"
    good = json.dumps({"transcript": "A: hello there", "summary": "A greets."})
    path.write_text(f"{good}\n{good}\n{line}\n{good}\n")
    with pytest.raises(DataError) as err:
        load_rows(DataConfig(source=str(path)))
    assert f"{path}:3" in str(err.value)
    assert message in str(err.value)


def test_sample_source_has_both_splits():
    splits = load_rows(DataConfig(source="sample"))
    assert len(splits["train"]) > len(splits["validation"]) > 0
    assert not {r.transcript for r in splits["train"]} & {r.transcript for r in splits["validation"]}


def test_local_file_is_split_deterministically(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(
        "".join(json.dumps({"transcript": f"A: {i}", "summary": f"S{i}"}) + "\n" for i in range(20))
    )
    a, b = load_rows(DataConfig(source=str(path)), seed=1), load_rows(DataConfig(source=str(path)), seed=1)
    assert a == b
    assert len(a["validation"]) == 2 and len(a["train"]) == 18


def _meetings(path, n: int) -> str:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"transcript": f"A: item {i} is agreed.", "summary": f"S{i}"}) + "\n")
    return str(path)


@pytest.mark.parametrize("limit", [1, 3, 100])
def test_validation_rows_are_the_first_rows_of_the_split(tmp_path, limit):
    split_off = DataConfig(source=_meetings(tmp_path / "m.jsonl", 40), validation_fraction=0.25)
    for cfg in (split_off, DataConfig(source="sample")):
        want = load_rows(cfg, seed=3)["validation"][:limit]
        assert validation_rows(cfg, seed=3, limit=limit) == want and want


def test_validation_rows_hold_only_what_they_return(tmp_path):
    cfg = DataConfig(source=_meetings(tmp_path / "big.jsonl", 20_000))
    peaks = []
    for read in (lambda: validation_rows(cfg, limit=4), lambda: load_rows(cfg)):
        tracemalloc.start()
        read()
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    streamed, in_memory = peaks
    assert streamed * 20 < in_memory, peaks


def test_labels_cover_exactly_the_summary(tokenizer):
    fmt = formatter(tokenizer)
    row = SummaryRow("Anna: we pick yellow.\nTom: agreed.", "The team chose yellow.", "t:1")
    ex = fmt.encode(row)
    assert len(ex.input_ids) == len(ex.labels)
    targets = [t for t in ex.labels if t != IGNORE]
    assert tokenizer.decode(targets) == "The team chose yellow.<|im_end|>"
    # Shifted: wherever there is a label, it is the next input token.
    for t, label in enumerate(ex.labels):
        if label != IGNORE:
            assert label == ex.input_ids[t + 1] or t == len(ex.input_ids) - 1
    prompt = tokenizer.decode(ex.input_ids)
    assert prompt.startswith("<|im_start|>system\n")
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nThe team chose yellow.<|im_end|>" in prompt


@pytest.mark.parametrize("policy", ["head", "tail", "middle"])
def test_truncation_keeps_the_summary(tokenizer, policy):
    fmt = formatter(tokenizer, max_length=160, truncation=policy)
    transcript = "\n".join(f"Speaker{i}: point number {i} about the budget." for i in range(100))
    ex = fmt.encode(SummaryRow(transcript, "They discussed the budget.", "t:1"))
    assert len(ex.input_ids) == 160
    assert ex.truncated_tokens > 0
    assert tokenizer.decode([t for t in ex.labels if t != IGNORE]) == "They discussed the budget.<|im_end|>"
    text = tokenizer.decode(ex.input_ids)
    assert ("Speaker0:" in text) == (policy in ("head", "middle"))
    assert ("Speaker99:" in text) == (policy in ("tail", "middle"))


def test_no_room_for_transcript_is_an_error(tokenizer):
    fmt = formatter(tokenizer, max_length=64)
    with pytest.raises(DataError, match=r"meetings.jsonl:7: .* Raise data.max_length"):
        fmt.encode(SummaryRow("A: hi", "word " * 40, "meetings.jsonl:7"))


def test_global_batches_are_deterministic_epochs():
    steps = [global_batch_indices(s, n_rows=10, global_batch_size=4, seed=3) for s in range(5)]
    assert steps == [global_batch_indices(s, 10, 4, 3) for s in range(5)]
    stream = [i for batch in steps for i in batch]
    assert sorted(stream[:10]) == list(range(10))  # the first epoch visits every row once
    assert sorted(stream[10:20]) == list(range(10))
    assert global_batch_indices(0, 10, 4, seed=4) != steps[0]


def test_rank_slices_partition_the_global_batch(tokenizer):
    fmt = formatter(tokenizer)
    rows = [SummaryRow(f"A: item {i}", f"Item {i}.", f"t:{i}") for i in range(8)]
    examples = [fmt.encode(r) for r in rows]
    pieces = [mb for r in range(2) for mb in rank_micro_batches(examples, r, 2, micro_batch_size=2)]
    assert [e for mb in pieces for e in mb] == examples
    assert all(len(mb) == 2 for mb in pieces)


def test_collate_right_pads_without_loss(tokenizer):
    fmt = formatter(tokenizer)
    a = fmt.encode(SummaryRow("A: short", "Short.", "t:1"))
    b = fmt.encode(SummaryRow("A: a much longer transcript line here", "Longer summary here.", "t:2"))
    batch = collate([a, b], pad_id=tokenizer.pad_token_id)
    n = len(a.input_ids)
    assert batch["input_ids"].shape == (2, len(b.input_ids))
    assert batch["attention_mask"][0, n:].sum() == 0 and batch["attention_mask"][0, :n].all()
    assert (batch["labels"][0, n:] == IGNORE).all()
    assert int((batch["labels"] != IGNORE).sum()) == count_label_tokens([a, b])
    assert collate([a], tokenizer.pad_token_id, pad_to=300)["input_ids"].shape == (1, 300)
