"""`distft data preview`: the first training rows as the run tokenises them, the tokens that carry
loss inside [[...]]; and the run's header naming the data format. The marked spans are checked
against the rows themselves: exactly each summary, or each assistant turn, and its end-of-turn
token, never a prompt token. In-process, on the offline Qwen3 tokenizer: no model is loaded."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from distft.cli import main
from distft.config import DataConfig, load_config
from distft.data import IGNORE, Example, load_rows, loss_spans, training_rows
from distft.data.chat import split_summary
from distft.data.preview import Span, data_format
from distft.train.progress import TrainingProgress
from tests.helpers import write_jsonl

END = "<|im_end|>"  # Qwen3's end-of-turn token: trained after every answer
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
    *(
        {
            "messages": [
                {"role": "user", "content": f"Count to {i}"},
                {"role": "assistant", "content": f"{i}!"},
            ]
        }
        for i in range(2, 6)
    ),
]
ROW = re.compile(r"^--- training (?:row|pair) (\d+): (\S+) \((\w+)\) ---$", re.MULTILINE)


def preview(capsys, *argv: str) -> tuple[str, list[tuple[str, str, str]]]:
    """The header, and per row: origin, format, and what follows the row's title."""
    assert main(["data", "preview", *argv]) == 0
    out = capsys.readouterr().out
    parts = ROW.split(out)
    rows = [(parts[i + 1], parts[i + 2], parts[i + 3]) for i in range(1, len(parts), 4)]
    return parts[0], rows


def marked(body: str) -> list[str]:
    return re.findall(r"\[\[(.*?)\]\]", body, flags=re.DOTALL)


def test_sample_rows_mark_exactly_each_summary(capsys):
    header, rows = preview(capsys, "--model", "micro", "--rows", "2")
    assert header.startswith("data: sample, format summary (detected); max_length 768, truncation middle")
    expected = load_rows(DataConfig())["train"][:2]  # the sample's own train split, in its order
    assert [origin for origin, _, _ in rows] == [r.origin for r in expected]
    for (_, fmt, body), row in zip(rows, expected, strict=True):
        assert fmt == "summary"
        assert marked(body) == [row.summary + END]
        assert row.summary[:40] not in body.split("[[")[0]  # the transcript before it is context
        count = re.search(r"^([\d,]+) tokens, ([\d,]+) carry loss; not truncated$", body, re.MULTILINE)
        assert count and int(count[2]) < int(count[1].replace(",", ""))


def test_a_chat_file_marks_every_assistant_turn_and_skips_held_out_rows(tmp_path, capsys):
    data = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    header, rows = preview(capsys, "--data", str(data), "--rows", "9", "data.validation_fraction=0.2")
    assert "format chat (detected)" in header
    cfg = load_config(None, [f"data.source={data}", "data.validation_fraction=0.2"])
    held_out = {r.origin for r in load_rows(cfg.data, cfg.train.seed)["validation"]}
    shown = [origin for origin, _, _ in rows]
    assert shown == [f"{data}:{i}" for i in range(1, 6) if f"{data}:{i}" not in held_out]
    assert len(shown) == 4 and "the training split has 4 rows, all shown" in rows[-1][2]
    for origin, fmt, body in rows:
        record = CHATS[int(origin.rsplit(":", 1)[1]) - 1]
        answers = [m["content"] + END for m in record["messages"] if m["role"] == "assistant"]
        assert fmt == "chat" and marked(body) == answers


def test_a_truncated_row_says_so_and_its_answer_is_whole(capsys):
    _, [(_, _, body)] = preview(capsys, "--model", "micro", "data.max_length=200")
    assert marked(body) == [load_rows(DataConfig())["train"][0].summary + END]
    assert re.search(r"^200 tokens, \d+ carry loss; truncated: [\d,]+ tokens cut", body, re.MULTILINE)


def test_rows_below_one_are_refused_in_one_line(capsys):
    assert main(["data", "preview", "--rows", "0"]) == 2
    assert (
        capsys.readouterr().err
        == "distft data: error: --rows must be at least 1, got 0: it is how many rows to show.\n"
    )


def test_loss_spans_follow_the_shifted_labels():
    # labels[t] is what position t predicts: tokens 2 and 3 (ids 12, 13) carry loss
    example = Example([10, 11, 12, 13, 14], [IGNORE, 12, 13, IGNORE, IGNORE], 0)
    assert loss_spans(example) == [Span(0, 2, False), Span(2, 4, True), Span(4, 5, False)]


@pytest.mark.parametrize("max_rows", [0, 2])
def test_training_rows_are_the_training_split_in_file_order(tmp_path, max_rows):
    data = DataConfig(
        source=str(write_jsonl(tmp_path / "c.jsonl", CHATS)), validation_fraction=0.4, max_rows=max_rows
    )
    train = load_rows(data, seed=3)["train"]
    in_file_order = sorted(train, key=lambda r: int(r.origin.rsplit(":", 1)[1]))
    assert training_rows(data, seed=3, limit=10) == in_file_order
    assert training_rows(data, seed=3, limit=1) == in_file_order[:1]


def test_the_format_is_named_as_set_as_detected_and_per_source(tmp_path):
    chats = str(write_jsonl(tmp_path / "c.jsonl", CHATS))
    assert data_format(DataConfig()) == "summary (detected)"
    assert data_format(DataConfig(source=chats, format="sharegpt")) == "sharegpt"  # as set, unread
    mixture = DataConfig(sources=[{"source": "sample"}, {"source": chats}])
    assert data_format(mixture) == "summary (detected), chat (detected)"
    assert data_format(replace(DataConfig(), source="memory:3 rows:abc")) == "auto (detected per row)"


def test_the_training_header_names_the_format(capsys):
    cfg = load_config(None, ["model.name=micro"])
    summary = split_summary([40, 18], [0, 0])
    TrainingProgress(True, 1).header(cfg, 1, "cpu", "none", (1, 2), (1, 1, 1), {"train": summary})
    out = " ".join(capsys.readouterr().out.split())  # the table's title may wrap
    assert "data: sample, format summary (detected), max_length 768, truncation middle" in out


PAIRS = [
    {"prompt": "Who owns the budget?", "chosen": "Anna, by Friday.", "rejected": "Bob, by Monday."},
    {
        "chosen": [
            {"role": "user", "content": "Who drafts it?"},
            {"role": "assistant", "content": "Tom drafts it."},
        ],
        "rejected": [
            {"role": "user", "content": "Who drafts it?"},
            {"role": "assistant", "content": "Nobody does."},
        ],
    },
]


def sides(body: str) -> dict[str, str]:
    """A pair's body cut into its named sides: the line that names each, and what follows it."""
    parts = re.split(r"^(chosen|rejected)\b(.*)$", body, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] + parts[i + 2] for i in range(1, len(parts), 3)}


@pytest.mark.parametrize("objective", ["dpo", "orpo", "kto"])
def test_a_pair_shows_both_sides_each_with_its_answer_marked(objective, tmp_path, capsys):
    """Both answers of each pair, each decoded with the tokens the objective trains marked: the
    answers alone, never the prompt the two share."""
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS * 3)
    header, rows = preview(capsys, "--data", str(data), "--rows", "6", f"train.objective={objective}")
    noun = "rows" if objective == "kto" else "pairs"  # KTO reads a pair as two answers: a row stays a row
    assert f"the training split has 5 {noun}, all shown" in rows[-1][2]
    assert "format preference (detected)" in header and len(rows) == 5  # one held out for validation
    lines = [int(origin.rsplit(":", 1)[1]) for origin, _, _ in rows]
    assert {line % 2 for line in lines} == {0, 1}  # both shapes: answers to a prompt, conversations
    for (_, fmt, body), line in zip(rows, lines, strict=True):
        record = PAIRS[(line - 1) % 2]
        assert fmt == "preference"
        shown = sides(body)
        assert list(shown) == ["chosen", "rejected"]
        for side, text in shown.items():
            answer = record[side] if isinstance(record[side], str) else record[side][-1]["content"]
            assert marked(text) == [answer + END]
            assert "Who" in text.split("[[")[0]  # the prompt, unmarked, before it
            assert re.search(r"^\d+ tokens, \d carry loss; not truncated$", text, re.MULTILINE)
        if objective == "kto":
            assert body.count("(desirable):") == 1 and "rejected (undesirable):" in body


def test_a_pair_is_shown_cut_to_the_runs_limits(tmp_path, capsys):
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS * 3)
    _, rows = preview(capsys, "--data", str(data), "train.objective=dpo", "dpo.max_completion_length=2")
    for side, text in sides(rows[0][2]).items():
        (answer,) = marked(text)  # its first two tokens, without the end of its turn
        assert PAIRS[0][side].startswith(answer) and len(answer) < len(PAIRS[0][side])
        assert "cut (dpo.max_prompt_length=0, dpo.max_completion_length=2)" in text


def test_a_pair_under_sft_shows_its_rejected_side_untrained(tmp_path, capsys):
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS[:1] * 2)
    _, [(_, _, body)] = preview(capsys, "--data", str(data))
    shown = sides(body)
    assert marked(shown["chosen"]) == ["Anna, by Friday." + END]
    assert marked(shown["rejected"]) == [] and "Bob, by Monday." + END in shown["rejected"]
    assert shown["rejected"].startswith(": not trained: train.objective=sft learns the chosen answer")
    assert re.search(r"^\d+ tokens, 0 carry loss; not truncated$", shown["rejected"], re.MULTILINE)


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ({"prompt": "Q", "chosen": "A"}, "missing field `rejected` (row has: chosen, prompt); a preference row"),
        (
            {"chosen": PAIRS[1]["chosen"], "rejected": [{"role": "user", "content": "Who signs it?"},
                                                        PAIRS[1]["rejected"][1]]},
            "`chosen` and `rejected` must share every turn before the final assistant answer (the prompt), "
            "and turn 0 differs: user 'Who drafts it?' in `chosen`, user 'Who signs it?' in `rejected`.",
        ),
    ],
    ids=["missing rejected", "user turns differ"],
)  # fmt: skip
def test_a_bad_pair_is_refused_in_one_line_with_its_file_and_line(bad, says, tmp_path, capsys):
    data = write_jsonl(tmp_path / "pairs.jsonl", [*PAIRS, bad])
    assert main(["data", "preview", "--data", str(data), "train.objective=dpo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"distft data: error: {data}:3: {says}") and err.count("\n") == 1
