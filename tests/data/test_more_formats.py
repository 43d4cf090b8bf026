"""ShareGPT and plain-text rows, alpaca found by its `instruction`, rows too long to fit skipped
(data.skip_long_rows), and an unreachable hub refused at once for a dataset id."""

import socket
import time

import pytest

from distft.config import DataConfig, load_config
from distft.data import (
    IGNORE,
    ChatFormatter,
    ChatRow,
    Message,
    SummaryRow,
    load_rows,
    row_from_record,
    skipped_line,
    tokenized_splits,
)
from distft.data import rows as rows_module
from distft.data.formats import TextRow
from distft.errors import ConfigError, DataError
from tests.data.test_formats import CHAT
from tests.helpers import write_jsonl

# test_formats' chat, as ShareGPT writes it: `from`/`value` turns, human and gpt for user and assistant.
SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}
SHAREGPT = {
    "conversations": [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]} for m in CHAT["messages"]]
}


def target_runs(tokenizer, labels) -> list[str]:
    runs, run = [], []
    for label in [*labels, IGNORE]:
        if label == IGNORE and run:
            runs.append(tokenizer.decode(run))
            run = []
        elif label != IGNORE:
            run.append(label)
    return runs


# ---- ShareGPT --------------------------------------------------------------------------------


def test_sharegpt_is_detected_and_read_as_a_chat(tokenizer):
    row = row_from_record(SHAREGPT, DataConfig(), "x:1")
    assert isinstance(row, ChatRow)
    assert [m.role for m in row.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert row == row_from_record(SHAREGPT, DataConfig(format="sharegpt"), "x:1")
    assert row.messages == row_from_record(CHAT, DataConfig(), "x:1").messages  # the same chat
    example = ChatFormatter(tokenizer, DataConfig()).encode(row)
    assert target_runs(tokenizer, example.labels) == ["Bonjour<|im_end|>", "Merci<|im_end|>"]


def test_the_role_map_adds_names_and_an_unknown_one_is_refused_with_the_roles_seen(tmp_path):
    record = {"conversations": [{"from": "narrator", "value": "Be brief."}, *SHAREGPT["conversations"][1:3]]}
    path = write_jsonl(tmp_path / "sg.jsonl", [SHAREGPT, record, SHAREGPT])
    with pytest.raises(DataError) as err:
        load_rows(DataConfig(source=str(path)))
    message = str(err.value)
    assert f"{path}:2: turn 0 is from 'narrator'" in message
    assert "from: gpt, human, narrator" in message and "data.roles" in message
    rows = load_rows(DataConfig(source=str(path), roles={"narrator": "system"}, validation_fraction=0.4))
    assert Message("system", ("Be brief.",)) in [
        m for r in rows["train"] + rows["validation"] for m in r.messages
    ]
    with pytest.raises(ConfigError, match=r"`data\.roles\.narrator` is 'robot'"):
        load_config(None, ['data.roles={narrator = "robot"}'])


# ---- plain text ------------------------------------------------------------------------------


def test_text_rows_carry_loss_on_every_token_and_are_cut_to_fit(tokenizer):
    text = "The quick brown fox jumps over the lazy dog. " * 3
    row = row_from_record({"text": text}, DataConfig(), "x:1")
    assert row == TextRow(text.strip(), "x:1")
    example = ChatFormatter(tokenizer, DataConfig()).encode(row)
    assert example.input_ids == [*tokenizer.encode(text.strip()), tokenizer.eos_token_id]  # no template
    assert example.labels == [*example.input_ids[1:], IGNORE] and example.truncated_tokens == 0
    long = TextRow("word " * 200, "x:2")
    cut = ChatFormatter(tokenizer, DataConfig(max_length=40, truncation="head")).encode(long)
    assert len(cut.input_ids) == 40 and cut.input_ids[-1] == tokenizer.eos_token_id
    assert cut.truncated_tokens == len(tokenizer.encode(long.text)) + 1 - 40
    # `text` is the format of last resort: a chat that also carries its rendered text is a chat.
    assert isinstance(row_from_record({"text": "x", **SHAREGPT}, DataConfig(), "x:3"), ChatRow)
    with pytest.raises(DataError, match="missing field `text`"):
        row_from_record({"body": "x"}, DataConfig(format="text"), "x:4")


def test_alpaca_is_found_by_its_instruction_and_qmsum_stays_a_summary():
    alpaca = {"instruction": "Translate to German.", "input": "Good night", "output": "Gute Nacht"}
    row = row_from_record(alpaca, DataConfig(), "x:1")
    assert row.messages == (
        Message("user", ("Translate to German.", "Good night")),
        Message("assistant", ("Gute Nacht",)),
    )
    assert isinstance(row_from_record({"input": "A: hi", "output": "Hi."}, DataConfig(), "x:2"), SummaryRow)


# ---- rows too long to fit --------------------------------------------------------------------


def test_skip_long_rows_skips_and_counts_what_would_abort_the_run(tmp_path, tokenizer):
    good = {"prompt": "Capital of France?", "completion": "Paris."}
    long = {"prompt": "Say it at length.", "completion": "very " * 80}
    path = write_jsonl(tmp_path / "rows.jsonl", [good] * 4 + [long] + [good] * 4 + [long])
    cfg = DataConfig(source=str(path), max_length=64, cache_dir=str(tmp_path / "c"), validation_fraction=0.3)
    with pytest.raises(DataError, match=rf"{path}:5: the answer .* data.skip_long_rows=true"):
        tokenized_splits(cfg, 0, tokenizer)
    cfg.skip_long_rows = True
    cached = tokenized_splits(cfg, 0, tokenizer)
    cfg.cache = False
    memory = tokenized_splits(cfg, 0, tokenizer)
    for split in (0, 1):  # the cache and memory agree: the same examples, the same summary
        assert [cached[split][i] for i in range(len(cached[split]))] == memory[split].examples
        assert cached[split].summary() == memory[split].summary()
    summaries = {"train": memory[0].summary(), "validation": memory[1].summary()}
    assert sum(s["skipped_rows"] for s in summaries.values()) == 2
    assert sorted(o for s in summaries.values() for o in s["skipped_first"]) == [f"{path}:10", f"{path}:5"]
    assert len(memory[0]) + len(memory[1]) == 8
    line = skipped_line(summaries)
    assert line.startswith("skipped ") and f"{path}:5" in line and "data.skip_long_rows" in line


# ---- the hub unreachable ---------------------------------------------------------------------


def test_an_offline_hub_dataset_fails_at_once_from_the_local_cache(tmp_path, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the test touched the network")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(rows_module, "hub_offline", lambda: True)  # the probe's answer, unreachable
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    start = time.perf_counter()
    with pytest.raises(DataError) as err:
        load_rows(DataConfig(source="distft-tests/no-such-dataset"))
    assert time.perf_counter() - start < 10  # not huggingface_hub's retries (~30 s)
    message = str(err.value)
    assert "Could not load dataset 'distft-tests/no-such-dataset'" in message
    assert "cannot be reached" in message and "the network" not in message
    import datasets.config
    import huggingface_hub.constants

    assert not datasets.config.HF_HUB_OFFLINE and not huggingface_hub.constants.HF_HUB_OFFLINE  # put back
