"""The options a user coming from axolotl or LLaMA-Factory expects: `data.train_on_inputs` (loss on
the prompt too, in every format), `data.chat_template` (a Jinja template of the user's in place
of the tokenizer's, its label mask exact, a bad one refused naming the setting, saved with the
tokenizer) and CSV files (the same rows as JSON lines, a malformed row named by its line). Both
settings are part of the token cache's key. In-process, on the offline Qwen3 tokenizer."""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path

import pytest

from distft.cli import main
from distft.config import DataConfig, load_config
from distft.data import (
    IGNORE,
    ChatFormatter,
    check_chat_template,
    collate,
    iter_file,
    load_rows,
    load_tokenizer,
    pack,
    row_from_record,
)
from distft.data.cache import cache_key, cache_path, open_or_build
from distft.data.chat_template import with_chat_template
from distft.data.formats import ChatRow, Message
from distft.data.preview import decode, loss_spans
from distft.data.tokenizer import save_tokenizer
from distft.errors import ConfigError, DataError
from distft.train.prepare import prepare_data, resolve_local_paths
from tests.data.test_formats import assert_shifted, targets

END = "<|im_end|>"


def trained_texts(tokenizer, example) -> list[str]:
    """The decoded text of each run of tokens that carries loss, special tokens included."""
    return [decode(tokenizer, example.input_ids[s.start : s.end]) for s in loss_spans(example) if s.trained]


# One row of each format, and a text of its prompt that loss reaches only with train_on_inputs.
RECORDS = {
    "summary": ({"transcript": "Anna: we ship on Friday.", "summary": "Ships Friday."}, "we ship on Friday"),
    "chat": (
        {
            "messages": [
                {"role": "system", "content": "You answer in French."},
                {"role": "user", "content": "Good morning"},
                {"role": "assistant", "content": "Bonjour"},
            ]
        },
        "You answer in French.",
    ),
    "prompt_completion": ({"prompt": "Capital of France?", "completion": "Paris."}, "Capital of France?"),
    "alpaca": (
        {"instruction": "Translate to German.", "input": "Good night", "output": "Gute Nacht"},
        "Translate to German.\n\nGood night",
    ),
    "sharegpt": (
        {"conversations": [{"from": "human", "value": "Hello there"}, {"from": "gpt", "value": "Hi!"}]},
        "Hello there",
    ),
    "text": ({"text": "Qwen3 is a family of language models."}, "is a family of language"),
}
# A template of the user's: no Qwen3 role headers, `### role` lines, each turn closed by the
# vocabulary's <|im_end|> (a special token: where an answer ends and generation stops).
TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant\n{% endif %}"
)
CHAT = ChatRow(
    (
        Message("system", ("Be brief.",)),
        Message("user", ("Where is the remote?",)),
        Message("assistant", ("On the table.",)),
        Message("user", ("And the budget?",)),
        Message("assistant", ("Ten euros, fixed.",)),
    ),
    "chat.jsonl:1",
)


# ---- data.train_on_inputs -------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(RECORDS))
def test_train_on_inputs_labels_every_prompt_token_and_never_padding(tokenizer, fmt):
    record, prompt = RECORDS[fmt]
    row = row_from_record(record, DataConfig(), "rows.jsonl:1")
    answers = ChatFormatter(tokenizer, DataConfig(max_length=512)).encode(row)
    everything = ChatFormatter(tokenizer, DataConfig(max_length=512, train_on_inputs=True)).encode(row)
    assert everything.input_ids == answers.input_ids  # the same tokens; only where loss falls moves
    assert_shifted(everything)
    # Every position predicts the next token: each token of the row but the first carries loss.
    assert everything.labels == [*everything.input_ids[1:], IGNORE]
    (trained,) = trained_texts(tokenizer, everything)
    assert prompt in trained
    if fmt == "text":  # plain text: loss on every token either way
        assert answers.labels == everything.labels
    else:
        assert not any(prompt in text for text in trained_texts(tokenizer, answers))
        assert all(t.endswith(END) for t in targets(tokenizer, answers))
    short = replace(everything, input_ids=everything.input_ids[:5], labels=[*everything.labels[:4], IGNORE])
    padded = collate([everything, short], pad_id=tokenizer.pad_token_id, pad_to=len(everything.input_ids) + 7)
    assert (padded["labels"][padded["attention_mask"] == 0] == IGNORE).all()
    assert (padded["labels"][1, 5:] == IGNORE).all() and (padded["labels"][0, -8:] == IGNORE).all()
    packed = pack([everything, short], pad_id=tokenizer.pad_token_id, multiple=64)
    assert (packed["labels"][0, len(everything.input_ids) + 5 :] == IGNORE).all()
    assert packed["labels"][0, len(everything.input_ids) - 1] == IGNORE  # no look into the next row


# ---- data.chat_template -----------------------------------------------------------------------


def test_a_custom_template_renders_and_labels_exactly_each_answer(tmp_path, tokenizer):
    path = tmp_path / "turns.jinja"
    path.write_text(TEMPLATE)
    before = tokenizer.chat_template
    formatter = ChatFormatter(tokenizer, DataConfig(max_length=512, chat_template=str(path)))
    example = formatter.encode(CHAT)
    assert tokenizer.chat_template == before  # the shared tokenizer keeps its own
    assert formatter.end.token == END
    chat = [{"role": m.role, "content": m.content} for m in CHAT.messages]
    rendered = "".join(f"### {m['role']}\n{m['content']}{END}\n" for m in chat)
    assert tokenizer.decode(example.input_ids) == rendered.removesuffix("\n")  # cut after the last target
    assert_shifted(example)
    assert targets(tokenizer, example) == [f"On the table.{END}", f"Ten euros, fixed.{END}"]
    prompt = formatter.generation_ids(list(CHAT.messages[:4]))
    asked = "".join(f"### {m['role']}\n{m['content']}{END}\n" for m in chat[:4]) + "### assistant\n"
    assert tokenizer.decode(prompt) == asked
    # Inline, the same template gives the same example; with train_on_inputs, the whole chat.
    assert (
        ChatFormatter(tokenizer, DataConfig(max_length=512, chat_template=TEMPLATE)).encode(CHAT) == example
    )
    both = DataConfig(max_length=512, chat_template=TEMPLATE, train_on_inputs=True)
    assert trained_texts(tokenizer, ChatFormatter(tokenizer, both).encode(CHAT)) == [
        rendered.removeprefix("###").removesuffix("\n")  # the first token (`###`) predicts nothing
    ]


BAD_TEMPLATES = [
    ("{% for m in messages %}{{ m['content'] }", "is not a Jinja template that parses: line 1"),
    (
        "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}<|im_end|>{% endif %}{% endfor %}",
        "does not write an assistant message's content",
    ),
    ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}", "holds no special token"),
    ("chatml", "is neither a Jinja chat template"),
    ("missing.jinja", "the template file cannot be read"),
]


@pytest.mark.parametrize(
    ("template", "phrase"), BAD_TEMPLATES, ids=[p.split(":")[0] for _, p in BAD_TEMPLATES]
)
def test_a_bad_template_is_refused_before_launch_naming_the_setting(tmp_path, monkeypatch, template, phrase):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["model.name=micro", f"data.chat_template={json.dumps(template)}"])
    with pytest.raises(ConfigError) as err:
        resolve_local_paths(cfg)
        prepare_data(cfg)  # what `distft train` runs in the launching process, before any rank
    message = str(err.value)
    assert "data.chat_template" in message and phrase in message, message
    assert "\n" not in message


def test_a_template_file_is_made_absolute_parsed_at_its_line_and_saved_with_the_tokenizer(
    tmp_path, tokenizer, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    Path("turns.jinja").write_text(TEMPLATE)
    cfg = load_config(None, ["data.chat_template=turns.jinja"])
    resolve_local_paths(cfg)
    assert cfg.data.chat_template == str(tmp_path / "turns.jinja")  # the ranks, eval, infer: any directory
    Path("broken.jinja").write_text("{% for m in messages %}\n{{ m['content'] }}\n{% endfor")
    with pytest.raises(ConfigError, match=r"data.chat_template \(broken.jinja\) is not .* line 3"):
        with_chat_template(tokenizer, "broken.jinja")
    monkeypatch.setenv("DISTFT_CACHE", str(tmp_path / "cache"))  # save_tokenizer's copy of the files
    save_tokenizer(with_chat_template(tokenizer, cfg.data.chat_template), tmp_path / "base")
    saved = load_tokenizer(str(tmp_path / "base"))  # as `distft infer`/`export` load RUN/base
    assert saved.chat_template == TEMPLATE
    assert check_chat_template(saved, DataConfig()).token == END


# ---- the token cache's key ---------------------------------------------------------------------


def test_the_cache_key_follows_both_settings_and_the_template_file(tmp_path, tokenizer):
    rows = tmp_path / "m.jsonl"
    rows.write_text(
        "".join(json.dumps({**RECORDS["summary"][0], "summary": f"S{i}."}) + "\n" for i in range(10))
    )
    template = tmp_path / "turns.jinja"
    template.write_text(TEMPLATE)
    cfg = DataConfig(source=str(rows), cache_dir=str(tmp_path / "c"))

    def path(c: DataConfig) -> Path:
        return cache_path(c, cache_key(c, 0, tokenizer))

    keys = {
        path(cfg),
        path(replace(cfg, train_on_inputs=True)),
        path(replace(cfg, chat_template=str(template))),
        path(replace(cfg, chat_template=TEMPLATE)),
    }
    assert len(keys) == 4
    before = path(replace(cfg, chat_template=str(template)))
    template.write_text(TEMPLATE.replace("###", "##"))  # the same path, another template
    assert path(replace(cfg, chat_template=str(template))) != before
    # The store keeps the prompt's labels: the cache gives what tokenising in memory gives.
    on = replace(cfg, train_on_inputs=True)
    cached = open_or_build(on, 0, tokenizer).train
    memory = [ChatFormatter(tokenizer, on).encode(r) for r in load_rows(on)["train"]]
    assert [cached[i] for i in range(len(cached))] == memory
    assert all(e.labels == [*e.input_ids[1:], IGNORE] for e in memory)


# ---- CSV files -------------------------------------------------------------------------------

CSV_ROWS = [  # commas, quotes, line breaks and non-ASCII inside fields: quoted as CSV quotes them
    {"prompt": 'Say "hi", then stop.', "completion": "hi"},
    {"prompt": "Two lines:\nfirst, then second", "completion": "Done, café."},
    {"prompt": "42", "completion": "a number stays text"},
]


def write_both(tmp_path: Path, records: list[dict], name: str = "rows") -> tuple[Path, Path]:
    jsonl, table = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.csv"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    with table.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    return jsonl, table


def unplaced(rows) -> list:
    return [replace(r, origin="") for r in rows]


@pytest.mark.parametrize(
    "records",
    [
        CSV_ROWS,
        [{"transcript": 'A: yes, "yellow".\nB: agreed.', "summary": f"Yellow {i}."} for i in range(4)],
        [
            {"instruction": "Translate.", "input": "Good night" if i % 2 else "", "output": "Gute Nacht"}
            for i in range(4)
        ],
        [{"text": f"Plain text, row {i}."} for i in range(4)],
    ],
    ids=["prompt_completion", "summary", "alpaca", "text"],
)
def test_csv_rows_read_as_the_same_rows_as_json_lines(tmp_path, records):
    jsonl, table = write_both(tmp_path, records)
    from_csv, from_jsonl = list(iter_file(table, DataConfig())), list(iter_file(jsonl, DataConfig()))
    assert unplaced(from_csv) == unplaced(from_jsonl) and len(from_csv) == len(records)
    assert [type(r) for r in from_csv] == [type(r) for r in from_jsonl]
    assert from_csv[0].origin == f"{table}:2"  # the header is line 1
    splits = load_rows(DataConfig(source=str(table), validation_fraction=0.25))
    assert {k: unplaced(v) for k, v in splits.items()} == {
        k: unplaced(v) for k, v in load_rows(DataConfig(source=str(jsonl), validation_fraction=0.25)).items()
    }


def test_csv_in_a_mixture_and_a_prompt_kept_as_text(tmp_path):
    jsonl, table = write_both(tmp_path, CSV_ROWS)
    mixed = load_rows(DataConfig(sources=[{"source": str(table)}, {"source": str(jsonl), "weight": 2.0}]))
    origins = {r.origin.rsplit(":", 1)[0] for r in mixed["train"] + mixed["validation"]}
    assert origins == {str(table), str(jsonl)}
    (_, second, third) = iter_file(table, DataConfig())
    assert second.origin == f"{table}:3" and third.origin == f"{table}:5"  # row 2 spans lines 3-4
    assert third.messages[0].content == "42"  # not a number: every cell is text
    meeting = tmp_path / "meeting.csv"  # inference: a meeting with an empty summary cell
    meeting.write_text("transcript,summary\nA: hello,\n")
    (row,) = iter_file(meeting, DataConfig(), need_answer=False)
    assert row.transcript == "A: hello" and row.summary == ""


MALFORMED = [
    (
        'prompt,completion\nok,fine\n"two\nlines",x\nthree,fields,here\n',
        "rows.csv:5: 3 fields, and the header row names 2",
    ),
    ("prompt,completion\nok,fine\nalone\n", "rows.csv:3: 1 field, and the header row names 2"),
    (
        'prompt,completion\nok,fine\n"open,quote\nnever closed\n',
        "rows.csv:3: not valid CSV (unexpected end of data)",
    ),
    ('prompt,completion\nok,fine\n"a"b,c\n', "rows.csv:3: not valid CSV (',' expected after '\"')"),
    ("prompt,completion\nok,fine\nno answer,\n", "rows.csv:3: field `completion` is empty"),
    ("prompt,prompt\na,b\n", "rows.csv:1: the header row names `prompt` twice"),
    ("prompt,completion\nok,caf\xe9\n", "rows.csv:2: not UTF-8 text (byte 0xE9"),
    (
        '{"prompt": "a", "completion": "b"}\n',
        "is not a CSV file: it looks like JSON lines; rename it rows.jsonl",
    ),
    (
        b"PAR1" + bytes(100) + b"PAR1",
        "is not a CSV file: it looks like a Parquet file; rename it rows.parquet",
    ),
]


@pytest.mark.parametrize(("data", "phrase"), MALFORMED, ids=[p.split(": ", 1)[-1][:30] for _, p in MALFORMED])
def test_a_malformed_csv_row_is_refused_with_its_line(tmp_path, data, phrase):
    path = tmp_path / "rows.csv"
    path.write_bytes(data if isinstance(data, bytes) else data.encode("latin-1"))
    for read in (
        lambda: load_rows(DataConfig(source=str(path))),
        lambda: list(iter_file(path, DataConfig())),
    ):
        with pytest.raises(DataError) as err:
            read()
        message = str(err.value)
        assert phrase in message and "\n" not in message, message


# ---- distft data preview ----------------------------------------------------------------------


def test_preview_marks_the_prompt_as_trained_and_renders_the_custom_template(tmp_path, capsys):
    jsonl, _ = write_both(tmp_path, CSV_ROWS * 2)
    argv = ["data", "preview", "--model", "micro", "--data", str(jsonl), "data.validation_fraction=0.2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "[[hi<|im_end|>]]" in out and "; the tokenizer of micro, its chat template\n" in out
    assert main([*argv, "data.train_on_inputs=true", f"data.chat_template={json.dumps(TEMPLATE)}"]) == 0
    out = capsys.readouterr().out
    assert "; the tokenizer of micro, the inline data.chat_template\n" in out  # the header names it
    # Every token but the first carries loss (train_on_inputs): micro's tokenizer reads "###" as "##", "#".
    assert '\n##[[# user\nSay "hi", then stop.<|im_end|>\n### assistant\nhi<|im_end|>]]' in out, out
    assert "<|im_start|>" not in out  # Qwen3's role headers: not this template's


def test_a_run_with_its_own_template_saves_it_with_the_adapter_and_every_reader_uses_it(tmp_path):
    """One 1-step run: the adapter holds the run's tokenizer (the template it trained with), which
    `distft infer --run`, `--adapter` alone and `distft export` all use."""
    from distft.config import load_config
    from distft.export import export_run
    from distft.infer import load_trained
    from distft.train import train

    out = tmp_path / "run"
    settings = ["model.name=micro", "train.max_steps=1", "train.global_batch_size=2", "train.micro_batch_size=2",
                "train.eval_batches=0", "data.max_length=384", "data.max_rows=4", f"output.dir={out}"]  # fmt: skip
    cfg = load_config(None, settings)
    cfg.data.chat_template = TEMPLATE
    train(cfg)
    assert load_tokenizer(str(out / "adapter")).chat_template == TEMPLATE
    assert load_trained(run=str(out)).tokenizer.chat_template == TEMPLATE
    assert load_trained(adapter=str(out / "adapter")).tokenizer.chat_template == TEMPLATE
    export_run(str(out), str(tmp_path / "export"), "float32", None, False)
    assert load_tokenizer(str(tmp_path / "export")).chat_template == TEMPLATE
