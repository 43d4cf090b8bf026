"""Every record carries model FLOPs per token and MFU; the first, the start-up time; the header says why MFU is null."""

from types import SimpleNamespace

import pytest

from distft.config import load_config
from distft.data import ChatFormatter, load_rows, load_tokenizer, tokenize_rows
from distft.measure.flops import ModelFlops
from distft.model import apply_method, load_base_model
from distft.train import train
from distft.train.step import global_batch
from tests.helpers import metrics

RUN = [
    "model.name=micro",
    "train.max_steps=3",
    "train.global_batch_size=2",
    "train.micro_batch_size=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "data.max_length=256",
    "data.max_rows=8",
    "optim.warmup_steps=1",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("speed")
    cfg = load_config(None, [*RUN, f"output.dir={out}"])
    return out, cfg


def test_records_carry_flops_per_token_and_a_null_mfu_on_cpu(run, capsys):
    out, cfg = run
    train(cfg)
    header = capsys.readouterr().out
    assert "start-up" in header and "MFU n/a" in header and "null on cpu" in header
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["startup_s"] > 0 and all("startup_s" not in r for r in records[1:])

    flops = ModelFlops.from_model(apply_method(load_base_model(cfg.model), cfg))
    formatter = ChatFormatter(load_tokenizer(None), cfg.data)
    train_set = tokenize_rows(load_rows(cfg.data, seed=cfg.train.seed)["train"], formatter)
    data = SimpleNamespace(cfg=cfg, train_set=train_set)  # what `global_batch` reads of a run
    for record in records:
        examples = global_batch(data, record["step"])
        assert record["mfu"] is None
        assert record["flops_per_token"] == pytest.approx(flops.step(examples) / record["tokens"], rel=1e-12)
