"""Datasets mixed by weight (`data.sources`): the rule, fixed by the seed; each source in its own
format; the token cache and the in-memory path train on the same rows; the cache key covers it."""

import json
from collections import Counter

import pytest

from distft.config import DataConfig, load_config
from distft.data import data_name, load_rows, tokenized_splits, validation_rows
from distft.data.cache import cache_key
from distft.data.mixture import mixture_picks, mixture_shares, starved_sources
from distft.errors import ConfigError
from distft.train import train
from tests.helpers import write_jsonl


@pytest.fixture
def two_sources(tmp_path):
    """A chat file of 10 rows and an alpaca file of 5: two formats, each detected."""
    chats = [
        {"messages": [{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": f"Hello {i}"}]}
        for i in range(10)
    ]
    alpaca = [
        {"instruction": f"Count to {i}.", "input": "", "output": " ".join(map(str, range(i)))}
        for i in range(1, 6)
    ]
    return write_jsonl(tmp_path / "chat.jsonl", chats), write_jsonl(tmp_path / "alpaca.jsonl", alpaca)


def test_each_source_contributes_its_weight_share_of_the_total():
    source, position = mixture_picks([10, 5], [1.0, 3.0], seed=0)
    assert len(source) == 15  # as many rows as the sources hold together
    taken = Counter(zip(source.tolist(), position.tolist(), strict=True))
    # source 0: round(1/4 x 15) = 4 of its 10 rows, each once; source 1: 11 = every row twice, one thrice
    assert (
        sum(n for (s, _), n in taken.items() if s == 0) == 4
        and max(taken[k] for k in taken if k[0] == 0) == 1
    )
    assert sorted(n for (s, _), n in taken.items() if s == 1) == [2, 2, 2, 2, 3]
    again = mixture_picks([10, 5], [1.0, 3.0], seed=0)
    assert (again[0] == source).all() and (again[1] == position).all()  # fixed by the seed
    other = mixture_picks([10, 5], [1.0, 3.0], seed=1)
    assert (other[0] != source).any() or (other[1] != position).any()


def test_a_mixture_reads_each_source_in_its_format_and_names_rows_by_file_and_line(two_sources):
    chat, alpaca = two_sources
    sources = [{"source": str(chat), "weight": 1.0}, {"source": str(alpaca), "weight": 1.0}]
    cfg = DataConfig(sources=sources, validation_fraction=0.2)
    splits = load_rows(cfg, seed=3)
    # Train: chat has 8, alpaca 4 after holding out; 12 in all, half from each by weight.
    origins = [r.origin for r in splits["train"]]
    assert len(origins) == 12 and sum(o.startswith(str(alpaca)) for o in origins) == 6
    assert all(o.rpartition(":")[2].isdigit() for o in origins)
    # Validation: each source's own held-out rows, in source order, unweighted.
    assert [r.origin.startswith(str(chat)) for r in splits["validation"]] == [True, True, False]
    assert validation_rows(cfg, seed=3, limit=3) == splits["validation"]
    assert (
        load_rows(DataConfig(sources=sources, validation_fraction=0.2, max_rows=5), seed=3)["train"]
        == (splits["train"][:5])
    )
    assert data_name(cfg) == f"mixture of {chat} (weight 1), {alpaca} (weight 1)"


def test_the_cache_trains_on_the_mixture_memory_does_and_keys_it(two_sources, tmp_path, tokenizer):
    chat, alpaca = two_sources
    sources = [{"source": str(chat), "weight": 2.0}, {"source": str(alpaca), "weight": 1.0}]
    cfg = DataConfig(sources=sources, cache_dir=str(tmp_path / "c"), validation_fraction=0.2)
    cached = tokenized_splits(cfg, 0, tokenizer)
    assert cached[2]["state"] == "built" and "mixture-" in cached[2]["path"]
    memory = tokenized_splits(DataConfig(sources=sources, cache=False, validation_fraction=0.2), 0, tokenizer)
    for split in (0, 1):
        assert [cached[split][i] for i in range(len(cached[split]))] == memory[split].examples
    key = cache_key(cfg, 0, tokenizer)
    assert [f["path"] for s in key["source"]["mixture"] for f in s["files"]] == [str(chat), str(alpaca)]
    reweighted = DataConfig(sources=[sources[0], {**sources[1], "weight": 3.0}], cache_dir=cfg.cache_dir)
    assert cache_key(reweighted, 0, tokenizer) != key


def test_sources_are_read_from_toml_and_refused_beside_a_source(tmp_path):
    path = tmp_path / "mix.toml"
    path.write_text(
        '[data]\n[[data.sources]]\nsource = "a.jsonl"\nweight = 2.0\n\n[[data.sources]]\nsource = "b.jsonl"\n'
    )
    assert load_config(path).data.sources == [{"source": "a.jsonl", "weight": 2.0}, {"source": "b.jsonl"}]
    with pytest.raises(ConfigError, match=r"data\.source='c\.jsonl' and data\.sources both name"):
        load_config(path, ["data.source=c.jsonl"])
    with pytest.raises(ConfigError, match=r"`data.sources\[0\].weight` must be a positive number"):
        load_config(None, ['data.sources=[{source = "a.jsonl", weight = -1}]'])
    with pytest.raises(ConfigError, match=r"data.sources\[0\].format"):
        load_config(None, ['data.sources=[{source = "a.jsonl", format = "csv"}]'])


def test_a_run_trains_on_a_mixture_of_sharegpt_and_text_rows(tmp_path, capsys):
    """End to end, once: a sharegpt file with a mapped speaker, and a file of text rows and one row
    too long to fit (skipped); the run's config.toml and lineage name the mixture."""
    sharegpt = [
        {
            "conversations": [
                {"from": "narrator", "value": "Be brief."},
                {"from": "human", "value": f"{i}+{i}?"},
                {"from": "gpt", "value": str(2 * i)},
            ]
        }
        for i in range(6)
    ]
    long = {"prompt": "Talk.", "completion": "very " * 400}  # its answer alone is over max_length
    texts = [long] + [{"text": f"Plain text number {i}."} for i in range(5)]  # formats mix in a file too
    a, b = write_jsonl(tmp_path / "sg.jsonl", sharegpt), write_jsonl(tmp_path / "text.jsonl", texts)
    overrides = [
        "model.name=micro", "train.max_steps=1", "train.global_batch_size=2", "train.micro_batch_size=2",
        "train.eval_batches=1", "data.max_length=256", "data.max_rows=8", "data.skip_long_rows=true",
        'data.roles={narrator = "system"}', "data.validation_fraction=0.2", f"data.cache_dir={tmp_path / 'c'}",
        f'data.sources=[{{source = "{a}", weight = 2.0}}, {{source = "{b}"}}]', f"output.dir={tmp_path / 'run'}",
    ]  # fmt: skip
    result = train(load_config(None, overrides))
    assert len(result.losses) == 1
    saved = load_config(result.output_dir / "config.toml").data
    assert saved.sources == [{"source": str(a), "weight": 2.0}, {"source": str(b)}]
    assert saved.roles == {"narrator": "system"} and saved.skip_long_rows
    stage = json.loads((result.output_dir / "lineage.json").read_text())["stages"][-1]
    assert stage["data"] == f"mixture of {a} (weight 2), {b} (weight 1)"


def test_a_source_whose_share_rounds_to_no_row_is_warned_of_where_the_mixture_is_composed(
    two_sources, tmp_path, tokenizer, capsys
):
    """A weight of 0.01 against 1 over 12 training rows: round(0.12) = 0 rows. Said by the in-memory
    path and the cache's build alike, naming the source, its weight and its rows."""
    chat, alpaca = two_sources
    sources = [{"source": str(chat), "weight": 1.0}, {"source": str(alpaca), "weight": 0.01}]
    cfg = DataConfig(sources=sources, validation_fraction=0.2)
    assert starved_sources(cfg, [8, 4]) == (
        f"warning: data.sources: {alpaca} (weight 0.01, 4 rows) contributes no row to the 12 training rows "
        "of the mixture: its share, weight / 1.01 of 12 rows, rounds to 0. Raise its weight, or leave it out."
    )
    assert starved_sources(cfg, [8, 0]) is None  # an empty source: nothing to lose
    assert mixture_shares([8, 4], [1.0, 0.01]) == [12, 0]
    rows = load_rows(cfg, seed=0)
    assert not any(r.origin.startswith(str(alpaca)) for r in rows["train"])
    assert f"{alpaca} (weight 0.01, 4 rows) contributes no row" in capsys.readouterr().err
    tokenized_splits(
        DataConfig(sources=sources, cache_dir=str(tmp_path / "c"), validation_fraction=0.2), 0, tokenizer
    )
    assert "contributes no row" in capsys.readouterr().err
