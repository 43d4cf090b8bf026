"""Inference and evaluation: decoding flags, batch files, notices, eval on a user's file,
and a quiet command line. One micro run, trained once, serves every test."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from types import SimpleNamespace

import pytest

from distft.cli import main
from distft.config import load_config, to_toml
from distft.export import model_card
from distft.infer import Sampling, generate, load_trained
from distft.infer.commands import model_labels
from distft.io.files import MANIFEST
from distft.io.lineage import run_lineage
from tests.helpers import distft

TRAIN = [
    "--model", "micro",
    "--max-steps", "2",
    "train.global_batch_size=2",
    "train.micro_batch_size=2",
    "train.eval_batches=1",
    "data.max_length=384",
    "data.max_rows=8",
]  # fmt: skip
MEETING = "Anna: we ship the remote on Friday.\nBen: the budget is fixed at ten euros.\n" * 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished micro run, trained as users train: `distft train` in its own process."""
    out = tmp_path_factory.mktemp("infer") / "run"
    proc = distft("train", *TRAIN, "--checkpoint-every", "1", "--out", str(out), fresh=True)
    return out, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def loaded(run):
    return load_trained(run=str(run[0]))


# ---- noise: none of the libraries' chatter reaches the user -----------------------------------

NOISE = [
    "Writing model shards",
    "Loading weights",
    "FutureWarning",
    "is_gradient_checkpointing",
    "torch.distributed is disabled",
    "assuming the intent is to save in a single process",
    "Warning",
    "Skipping publisher trust check",  # the kernels package, offline, of a kernel distft never loads
]


def test_train_infer_eval_export_print_no_library_noise(run, tmp_path):
    out, train_output = run
    # Fresh interpreters for train (the fixture) and infer: a library's warning at import time is
    # part of what the user would see, and the CLI imports every command's code. The others fork
    # from the test server, which has imported but run nothing: what they print at run time shows.
    # offline, as a user without network is: no library says so on every command
    infer = distft(
        "infer", "--run", str(out), "--max-new-tokens", "4", fresh=True, env={"HF_HUB_OFFLINE": "1"}
    )
    evaluate = distft("eval", "--run", str(out), "--rows", "1", "--max-new-tokens", "2")
    export = distft("export", "--run", str(out), "--out", str(tmp_path / "export"))
    ddp = ["--strategy", "ddp", "--nproc", "2", "train.micro_batch_size=1"]
    ranks = distft("train", *TRAIN, *ddp, "--out", str(tmp_path / "ddp"))  # forked ranks
    for output in (train_output, *(p.stdout + p.stderr for p in (infer, evaluate, export, ranks))):
        for noise in NOISE:
            assert noise not in output, f"{noise!r} in:\n{output}"
    assert "generated summary" in infer.stdout and "ROUGE-L" in evaluate.stdout
    assert export.stdout.startswith(f"exported {out} to ") and not export.stderr


# ---- decoding ---------------------------------------------------------------------------------


def test_greedy_is_deterministic_and_sampling_follows_the_seed(loaded):
    greedy = Sampling(max_new_tokens=8)
    assert generate(loaded, MEETING, greedy).summary == generate(loaded, MEETING, greedy).summary
    hot = Sampling(max_new_tokens=8, greedy=False, temperature=5.0, seed=1)
    first, again = generate(loaded, MEETING, hot), generate(loaded, MEETING, hot)
    assert first.summary == again.summary, "the same seed draws the same summary"
    others = {generate(loaded, MEETING, Sampling(8, False, 5.0, seed=s)).summary for s in range(2, 6)}
    assert others - {first.summary}, "another seed draws another summary at temperature 5"


def test_sampling_flags_reach_generate(loaded, monkeypatch, capsys):
    seen = {}
    real = loaded.model.generate

    def spy(**kwargs):
        seen.update(kwargs)
        return real(**kwargs)

    monkeypatch.setattr("distft.infer.commands.load_trained", lambda **kw: loaded)
    monkeypatch.setattr(loaded.model, "generate", spy)
    args = ["--temperature", "0.7", "--top-p", "0.9", "--top-k", "20", "--repetition-penalty", "1.2"]
    assert main(["infer", "--run", "unused", "--max-new-tokens", "3", *args]) == 0
    assert seen["do_sample"] and seen["temperature"] == 0.7 and seen["top_p"] == 0.9
    assert seen["top_k"] == 20 and seen["repetition_penalty"] == 1.2 and seen["max_new_tokens"] == 3
    assert main(["infer", "--run", "unused", "--max-new-tokens", "3"]) == 0
    assert seen["do_sample"] is False  # greedy by default
    capsys.readouterr()


# ---- notices ----------------------------------------------------------------------------------


def test_preset_base_and_truncation_are_told(run, tmp_path, capsys):
    long = tmp_path / "long.txt"
    long.write_text("Anna: " + "we discussed the remote control design and its budget " * 120)
    assert main(["infer", "--run", str(run[0]), "--input", str(long), "--max-new-tokens", "4"]) == 0
    err = capsys.readouterr().err
    said = " ".join(err.split())
    assert "this is not a real language model. It is distft's `micro` preset" in said
    assert "random initial weights (seed 0), trained only on the bundled synthetic meetings" in said
    assert "2 steps of LoRA (this run)" in said
    (notice,) = [line for line in err.splitlines() if line.startswith("notice: ")]
    dropped = int(notice.split("the transcript was truncated, ")[1].split()[0])
    assert dropped > 500 and "data.max_length=384" in notice and "4 tokens kept free" in notice


# ---- batch inference --------------------------------------------------------------------------


def test_batch_input_gives_one_summary_per_row(run, tmp_path, capsys):
    rows = tmp_path / "meetings.jsonl"
    rows.write_text(
        json.dumps({"transcript": MEETING})
        + "\n\n"
        + json.dumps({"dialogue": MEETING, "summary": "Ship Friday."})
        + "\n"
    )
    out = tmp_path / "summaries.jsonl"
    argv = [
        "infer",
        "--run",
        str(run[0]),
        "--input",
        str(rows),
        "--output",
        str(out),
        "--max-new-tokens",
        "3",
    ]
    assert main(argv) == 0
    assert f"wrote 2 summaries to {out}" in capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["origin"] for r in records] == [f"{rows}:1", f"{rows}:3"]  # file and line of each row
    assert all(isinstance(r["summary"], str) and r["dropped_tokens"] == 0 for r in records)
    assert "reference" not in records[0] and records[1]["reference"] == "Ship Friday."


def test_a_batch_that_fails_midway_leaves_no_output_file(loaded, tmp_path, monkeypatch, capsys):
    rows = tmp_path / "meetings.jsonl"
    rows.write_text("".join(json.dumps({"transcript": f"{MEETING} {i}"}) + "\n" for i in range(3)))
    done = []

    def generate_twice(loaded, row, sampling):
        if len(done) == 2:
            raise RuntimeError("out of memory")
        done.append(row.origin)  # rows arrive one at a time, as the file is read
        return generate(loaded, row, sampling)

    monkeypatch.setattr("distft.infer.commands.load_trained", lambda **kw: loaded)
    monkeypatch.setattr("distft.infer.commands.generate", generate_twice)
    out = tmp_path / "summaries.jsonl"
    code = main(
        ["infer", "--run", "unused", "--input", str(rows), "--output", str(out), "--max-new-tokens", "2"]
    )
    assert code == 1  # one line, no traceback (`distft.errors.run_command`)
    assert "error: out of memory (out of memory). Lower train.micro_batch_size" in capsys.readouterr().err
    assert done == [f"{rows}:1", f"{rows}:2"]
    assert list(tmp_path.iterdir()) == [rows]  # neither a half file nor its temporary


# ---- eval -------------------------------------------------------------------------------------


def test_eval_scores_a_user_file_and_writes_results(run, tmp_path, capsys):
    data = tmp_path / "mine.jsonl"
    data.write_text(
        "".join(json.dumps({"transcript": MEETING, "summary": f"Ship on day {i}."}) + "\n" for i in range(3))
    )
    results = tmp_path / "results.json"
    argv = ["eval", "--run", str(run[0]), "--data", str(data), "--rows", "2", "--max-new-tokens", "3"]
    assert main([*argv, "--output", str(results)]) == 0
    assert "2 meetings of" in capsys.readouterr().out
    scores = json.loads(results.read_text())
    assert scores["rows"] == [f"{data}:1", f"{data}:2"] and scores["data"] == str(data)
    assert scores["settings"]["max_new_tokens"] == 3
    for model in ("base", "finetuned"):
        assert scores["models"][model]["loss"] > 0 and 0 <= scores["models"][model]["rougeL"] <= 1


def test_a_preference_runs_eval_row_names_its_objective(tmp_path):
    """`distft eval`'s rows say what each stage did: DPO on LoRA, not "steps of LoRA" (an SFT
    run's stays so), from a random preset's lineage or a pretrained base's."""
    stage = ["train.max_steps=6", f"output.dir={tmp_path}"]
    for objective, said in [
        ("dpo", "+ 6 steps of DPO (LoRA, this run)"),
        ("sft", "+ 6 steps of LoRA (this run)"),
    ]:
        cfg = load_config(None, ["model.name=micro", f"train.objective={objective}", *stage])
        lineage = run_lineage(cfg, {"preset": "micro", "seed": 0})
        assert model_labels(SimpleNamespace(cfg=cfg, lineage=lineage, run=str(tmp_path)))["finetuned"] == said
    kto = load_config(None, ["model.name=org/base", "train.objective=kto", *stage])
    loaded = SimpleNamespace(
        cfg=kto, lineage={"origin": {"model": "org/base"}, "stages": []}, run=str(tmp_path)
    )
    assert model_labels(loaded) == {"base": "org/base", "finetuned": "+ 6 steps of KTO (LoRA)"}


# ---- every data format: a row's prompt is its turns before the last answer --------------------

CHATS = [
    {
        "messages": [
            {"role": "system", "content": "You answer in French."},
            {"role": "user", "content": "Good morning"},
            {"role": "assistant", "content": "Bonjour"},
            {"role": "user", "content": "Thank you"},
            {"role": "assistant", "content": "Merci beaucoup"},
        ]
    },
    {"messages": [{"role": "user", "content": "Good night"}, {"role": "assistant", "content": "Bonne nuit"}]},
]
ALPACAS = [
    {"instruction": "Translate to German.", "input": "Good night", "output": "Gute Nacht"},
    {"instruction": "Translate to German.", "input": "Thank you", "output": "Danke"},
]


@pytest.mark.parametrize("records", [CHATS, ALPACAS], ids=["chat", "alpaca"])
def test_eval_scores_chat_and_alpaca_files(records, run, tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    results = tmp_path / "results.json"
    argv = ["eval", "--run", str(run[0]), "--data", str(data), "--max-new-tokens", "3"]
    # alpaca's input/output also fit the qmsum summary schema: --format says which (the run trained on auto)
    fmt = ["--format", "alpaca"] if "instruction" in records[0] else []
    assert main([*argv, *fmt, "--output", str(results)]) == 0
    assert "2 rows of" in capsys.readouterr().out
    scores = json.loads(results.read_text())
    assert scores["rows"] == [f"{data}:1", f"{data}:2"]
    for model in ("base", "finetuned"):
        assert scores["models"][model]["loss"] > 0 and 0 <= scores["models"][model]["rougeL"] <= 1


TEXTS = [{"text": "Qwen3 is a family of language models."}, {"text": "It comes in dense sizes."}]


def test_rows_without_a_reference_have_no_rouge_and_the_mean_skips_them(run, tmp_path, monkeypatch, capsys):
    """A text row is all prompt: no reference, so its ROUGE-L is n/a, not 0. Every answer is made
    the chat row's own reference, so that row scores 1: a mean that counted the text row as 0
    would read 0.5."""
    asked = []

    def perfect(loaded, row, sampling):
        asked.append(row.origin)
        return SimpleNamespace(summary="Bonne nuit")

    monkeypatch.setattr("distft.infer.evaluate.generate", perfect)

    def evaluate(records: list[dict], name: str) -> tuple[dict, str, str]:
        data, results = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.json"
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
        argv = ["eval", "--run", str(run[0]), "--data", str(data), "--max-new-tokens", "2"]
        assert main([*argv, "--output", str(results)]) == 0
        out = capsys.readouterr()
        return json.loads(results.read_text())["models"], out.out, out.err

    mixed, table, note = evaluate([CHATS[1], TEXTS[0]], "mixed")
    assert (
        asked == [f"{tmp_path / 'mixed.jsonl'}:1"] * 2
    )  # base and finetuned; the text row is not generated for
    assert [s["rougeL"] for s in mixed.values()] == [1.0, 1.0]
    assert "ROUGE-L skips 1 row of 2 without a reference answer" in note and "other 1 row" in note
    texts, table, note = evaluate(TEXTS, "texts")
    assert [s["rougeL"] for s in texts.values()] == [None, None]  # null in the JSON
    assert len(asked) == 2  # nothing generated for text rows
    assert all(s["loss"] > 0 for s in texts.values())  # the loss covers them
    scored = [line for line in table.splitlines() if "base" in line or "finetuned" in line]
    assert len(scored) == 2 and all("n/a" in line and "0.0000" not in line for line in scored)
    assert "no row has one: n/a" in note


def test_batch_infer_on_a_chat_file_answers_every_row(run, tmp_path, capsys):
    """One output per row: its prompt is the chat up to its last answer, that answer its reference;
    a chat ending with a user turn is answered too, with no reference."""
    open_chat = {"messages": [*CHATS[0]["messages"][:2], {"role": "user", "content": "And goodbye?"}]}
    rows = tmp_path / "chats.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in [*CHATS, open_chat]))
    out = tmp_path / "answers.jsonl"
    argv = [
        "infer",
        "--run",
        str(run[0]),
        "--input",
        str(rows),
        "--output",
        str(out),
        "--max-new-tokens",
        "3",
    ]
    assert main(argv) == 0
    assert f"wrote 3 responses to {out}" in capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["origin"] for r in records] == [f"{rows}:{i}" for i in (1, 2, 3)]
    assert [r.get("reference") for r in records] == ["Merci beaucoup", "Bonne nuit", None]
    assert all(isinstance(r["response"], str) and "summary" not in r for r in records)
    # the prompt ends before the last answer: the first row's prompt holds "Bonjour", not "Merci"
    assert records[0]["prompt_tokens"] > records[1]["prompt_tokens"]
    assert records[2]["dropped_tokens"] == 0


def test_a_chat_ending_with_a_user_turn_is_generated_for(loaded, monkeypatch):
    from distft.data import ChatFormatter, row_from_record

    seen = {}
    real = loaded.model.generate

    def spy(**kwargs):
        seen["prompt"] = kwargs["input_ids"][0].tolist()
        return real(**kwargs)

    monkeypatch.setattr(loaded.model, "generate", spy)
    record = {"messages": [*CHATS[0]["messages"][:2], {"role": "user", "content": "And goodbye?"}]}
    row = row_from_record(record, loaded.cfg.data, "x:1", need_answer=False)
    result = generate(loaded, row, Sampling(max_new_tokens=3))
    text = loaded.tokenizer.decode(seen["prompt"])
    assert text.endswith(
        "<|im_start|>user\nAnd goodbye?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert seen["prompt"] == ChatFormatter(loaded.tokenizer, loaded.cfg.data).generation_ids(
        list(row.messages)
    )
    assert result.prompt_tokens == len(seen["prompt"]) and isinstance(result.summary, str)


# ---- rough edges: bad flags are one paragraph, exit 2, before any model is loaded -------------

BAD_FLAGS = [
    (["infer", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
    (["infer", "--greedy", "--temperature", "0.7"], "--greedy picks the most likely token, so --temperature"),
    (["infer", "--temperature", "0"], "--temperature must be positive"),
    (["infer", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["infer", "--temperature", "nan"], "--temperature must be positive, got nan"),
    (["infer", "--repetition-penalty", "inf"], "--repetition-penalty must be positive, got inf"),
    (["infer", "--input", "nope.txt"], "--input nope.txt does not exist"),
    (["eval", "--rows", "0"], "--rows must be at least 1, got 0"),
    (["eval", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
]


@pytest.mark.parametrize(("argv", "phrase"), BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flags_are_refused_before_loading(argv, phrase, run, monkeypatch, capsys):
    def loaded(**kwargs):
        raise AssertionError("the model was loaded for bad flags")

    monkeypatch.setattr("distft.infer.commands.load_trained", loaded)
    assert main([*argv, "--run", str(run[0])]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (message,) = [line for line in err.splitlines() if line.startswith(f"distft {argv[0]}: error: ")]
    assert phrase in message, err


@pytest.mark.parametrize(
    ("name", "data", "phrase"),
    [
        ("meeting.txt", "A: hi".encode("utf-16"), "meeting.txt is not UTF-8 text: it looks like UTF-16 text"),
        ("meeting.txt", b"A: hi\nB: caf\xe9\n", "meeting.txt:2: not UTF-8 text (byte 0xE9 at column 7"),
    ],
)
def test_an_input_that_is_not_utf8_text_is_refused_before_loading(
    name, data, phrase, tmp_path, monkeypatch, capsys
):
    def loaded(**kwargs):
        raise AssertionError("the model was loaded for an input it cannot read")

    monkeypatch.setattr("distft.infer.commands.load_trained", loaded)
    (tmp_path / name).write_bytes(data)
    assert main(["infer", "--run", str(tmp_path), "--input", str(tmp_path / name)]) == 2
    (message,) = [
        line for line in capsys.readouterr().err.splitlines() if line.startswith("distft infer: error: ")
    ]
    assert phrase in message


def test_a_relative_data_path_is_stored_absolute(tmp_path, run):
    """eval/infer read the run's config.toml from anywhere: its local data path is absolute."""
    (tmp_path / "data").mkdir()
    rows = "".join(
        json.dumps({"transcript": MEETING, "summary": f"Ship on day {i}."}) + "\n" for i in range(6)
    )
    (tmp_path / "data" / "mine.jsonl").write_text(rows)
    distft("train", *TRAIN, "--data", "data/mine.jsonl", "--out", "r", cwd=tmp_path)
    assert load_config(tmp_path / "r" / "config.toml").data.source == str(tmp_path / "data" / "mine.jsonl")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = distft("infer", "--run", "../r", "--max-new-tokens", "2", cwd=elsewhere)
    assert "generated summary" in proc.stdout


# ---- finished work: a damaged file is named, and nothing a run wrote is written over -------------


def damaged_copy(run, tmp_path, cut: int | None, manifest: bool = True):
    """A copy of the run whose adapter file is cut to `cut` bytes (half when None)."""
    copy = tmp_path / "copy"
    shutil.copytree(run[0], copy, ignore=shutil.ignore_patterns("checkpoints"))
    weights = copy / "adapter" / "adapter_model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size // 2 if cut is None else cut])
    if not manifest:
        (copy / "adapter" / MANIFEST).unlink()
    return copy, size


@pytest.mark.parametrize("cut", [None, 0], ids=["half", "empty"])
@pytest.mark.parametrize("command", ["infer", "eval", "export"])
def test_a_damaged_adapter_is_named_by_every_reader(command, cut, run, tmp_path, capsys):
    copy, size = damaged_copy(run, tmp_path, cut)
    extra = ["--out", str(tmp_path / "export")] if command == "export" else []
    assert main([command, "--run", str(copy), *extra]) == 2
    err = capsys.readouterr().err
    kept = size // 2 if cut is None else 0
    assert (
        f"error: The directory {copy / 'adapter'} is damaged: adapter_model.safetensors has {kept:,} bytes, {size:,} when written"
        in err
    )
    assert "Traceback" not in err and not (tmp_path / "export").exists()


def test_a_damaged_adapter_without_a_manifest_is_named_when_it_fails_to_load(run, tmp_path, capsys):
    copy, _ = damaged_copy(run, tmp_path, None, manifest=False)
    assert main(["infer", "--run", str(copy), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"error: {copy} cannot be loaded (SafetensorError: " in err and "A file in it is damaged" in err


OVER_THE_RUN = [
    (["infer", "--output", "{run}/adapter/out.jsonl"], "--output {run}/adapter/out.jsonl would write over its adapter of the run"),
    (["eval", "--output", "{run}/metrics.jsonl"], "would write over its metrics.jsonl of the run"),
    (["export", "--out", "{run}/base"], "--out {run}/base would write over its base of the run"),
    (["export", "--out", "{run}/.."], "holds the run"),
    (["infer", "--output", "/proc/distft/out.jsonl"], "Output directory /proc/distft is not writable"),
    (["train", "--resume", "{run}", "--max-steps", "1"], "finished at step 2, and train.max_steps=1 would train nothing more"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "phrase"), OVER_THE_RUN, ids=[" ".join(a[:2]) + a[2][-12:] for a, _ in OVER_THE_RUN]
)
def test_nothing_a_run_wrote_is_written_over_and_outputs_are_checked_first(
    argv, phrase, run, monkeypatch, capsys
):
    def loaded(**kwargs):
        raise AssertionError("the model was loaded before the output path was checked")

    for where in ("distft.infer.commands.load_trained", "distft.export.load_trained"):
        monkeypatch.setattr(where, loaded)
    before = {p: p.read_bytes() for p in run[0].rglob("*") if p.is_file()}
    argv = [a.replace("{run}", str(run[0])) for a in argv]
    assert main([argv[0], *(["--run", str(run[0])] if argv[0] != "train" else []), *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert phrase.replace("{run}", str(run[0])) in err and "Traceback" not in err, err
    assert {p: p.read_bytes() for p in run[0].rglob("*") if p.is_file()} == before


# ---- every format: infer's held-out reference, the model card; a run trained from memory ---------


def retargeted_copy(run, tmp_path, **data: str):
    """A copy of the run whose config.toml says it trained on other data (`data.KEY=VALUE`)."""
    copy = tmp_path / "copy"
    shutil.copytree(run[0], copy, ignore=shutil.ignore_patterns("checkpoints"))
    cfg = load_config(copy / "config.toml", [f"data.{k}={json.dumps(v)}" for k, v in data.items()])
    (copy / "config.toml").write_text(to_toml(cfg))
    return copy, cfg


def test_infer_prints_the_held_out_reference_of_a_chat_run(run, tmp_path, capsys):
    rows = tmp_path / "chats.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in CHATS * 3))
    copy, _ = retargeted_copy(run, tmp_path, source=str(rows), format="chat")
    assert main(["infer", "--run", str(copy), "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert (
        "--- generated answer ---" in out and "--- reference answer (held out, never trained on) ---" in out
    )
    reference = out.split("--- reference answer (held out, never trained on) ---\n", 1)[1].strip()
    assert reference in ("Merci beaucoup", "Bonne nuit")


def test_a_run_trained_from_memory_needs_its_rows_named(run, tmp_path, capsys):
    copy, _ = retargeted_copy(run, tmp_path, source="memory:12 rows:0123456789ab")
    for command in ("infer", "eval"):
        assert main([command, "--run", str(copy), "--max-new-tokens", "2"]) == 2
        err = capsys.readouterr().err
        assert "trained on rows handed to train() from Python (memory:12 rows:0123456789ab)" in err
        assert "distft infer --input FILE" in err and "distft eval --data FILE" in err


@pytest.mark.parametrize(
    ("fmt", "title", "use"),
    [
        ("chat", "chat", "a conversation in, the assistant's next turn out"),
        ("alpaca", "instruction following", "an instruction (and its input) in, the response out"),
        ("prompt_completion", "prompt completion", "a prompt in, its completion out"),
    ],
)
def test_the_model_card_follows_the_data_format(fmt, title, use, run, tmp_path):
    cfg = load_config(run[0] / "config.toml", [f"data.format={fmt}", "data.source=rows.jsonl"])
    card = model_card(cfg, run[0], "bfloat16")
    assert f"# run: {title}" in card and use in card
    assert "meeting" not in card.lower() and "transcript" not in card and "summarization" not in card
    assert 'messages = [{"role": "user", "content": prompt}]' in card
    meeting = model_card(load_config(run[0] / "config.toml"), run[0], "bfloat16")  # the sample: detected
    assert "# run: meeting summaries" in meeting and "+ transcript}]" in meeting


def test_an_answer_longer_than_the_runs_context_is_refused(run, capsys):
    assert main(["infer", "--run", str(run[0]), "--max-new-tokens", "99999999999"]) == 2
    err = capsys.readouterr().err
    assert (
        "--max-new-tokens 99999999999 leaves no room for the prompt: the run was trained on data.max_length=384"
        in err
    )
    assert "Give at most 352." in err


def test_a_pickled_adapter_is_never_unpickled(run, tmp_path, capsys):
    """peft falls back to `adapter_model.bin` when there is no safetensors file; distft refuses it."""
    copy, _ = damaged_copy(run, tmp_path, None, manifest=False)
    (copy / "adapter" / "adapter_model.safetensors").unlink()
    marker = tmp_path / "pwned"
    with (copy / "adapter" / "adapter_model.bin").open("wb") as f:
        pickle.dump(Planted(marker), f)
    assert main(["infer", "--run", str(copy), "--max-new-tokens", "2"]) == 2
    assert "holds no adapter_model.safetensors" in capsys.readouterr().err and not marker.exists()


class Planted:
    """Unpickling it runs a shell command (here, touching a marker)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_an_emptied_run_config_is_damage_not_defaults(run, tmp_path, capsys):
    copy, _ = damaged_copy(run, tmp_path, cut=10**9)  # the adapter intact
    (copy / "config.toml").write_text("")
    for command in (["infer"], ["export", "--out", str(tmp_path / "export")]):
        assert main([*command, "--run", str(copy)]) == 2
        assert f"{copy / 'config.toml'} has no [model], [data]" in capsys.readouterr().err


def test_infer_and_eval_take_data_overrides_and_piped_text_follows_the_trained_format(
    run, tmp_path, monkeypatch, capsys
):
    import io
    import sys

    rows = tmp_path / "chats.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in CHATS * 3))
    copy, _ = retargeted_copy(run, tmp_path, source=str(rows), format="auto")  # detected: chat
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Good evening")))
    assert main(["infer", "--run", str(copy), "--input", "-", "--max-new-tokens", "2"]) == 0
    assert "--- generated answer ---" in capsys.readouterr().out  # the user turn, not a meeting
    # ShareGPT rows with speaker names of their own: scored once data.roles maps them.
    narrated = tmp_path / "narrated.jsonl"
    turns = [
        {"from": "narrator", "value": "Be brief."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello"},
    ]
    narrated.write_text(json.dumps({"conversations": turns}) + "\n")
    base = ["eval", "--run", str(run[0]), "--data", str(narrated), "--rows", "1", "--max-new-tokens", "2"]
    assert main([*base, "--format", "sharegpt"]) == 2
    assert "narrator" in capsys.readouterr().err
    assert main([*base, "--format", "sharegpt", 'data.roles={narrator = "system"}']) == 0
    assert "1 rows of" in capsys.readouterr().out.replace("1 row of", "1 rows of")
    # Refused before the model loads: another section, and a value out of range.
    monkeypatch.setattr("distft.infer.commands.load_trained", None)  # any load would fail loudly
    assert main(["eval", "--run", str(run[0]), "model.name=tiny"]) == 2
    assert "infer and eval take [data] settings only" in capsys.readouterr().err
    assert main(["infer", "--run", str(run[0]), "data.max_length=8"]) == 2
    assert "`data.max_length` must be at least 32" in capsys.readouterr().err
