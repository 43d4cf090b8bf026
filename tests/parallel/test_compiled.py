"""Compiled decoder layers under data-parallel and pipeline strategies, for real (2 gloo ranks).

The CUDA path compiles the blocks (`model.compile=auto` on CUDA); here `model.compile=true` walks the
same code on the CPU with the `aot_eager` backend (dynamo and AOT autograd, no code generation, so
a run takes seconds, not minutes; fsdp and the pipeline with dynamo alone, `eager`). Every rank must report compiled graphs in `ranks.json`, the
step records and the printed lines, while the byte counter (a dispatch mode) measures every step.
Each strategy runs another family's micro preset: Qwen3's under ddp, Llama's (rope scaling, an
untied head; NF4 projections) under fsdp, Mistral's (an untied head on the last stage) under pp.
"""

import json

import pytest

from tests.helpers import PARITY, distft, metrics

COMPILED = ["model.compile=true", "model.compile_backend=aot_eager", "train.measure_comm=every"]
QLORA = ["--method", "qlora", "model.quant_scaler_block_size=4"]


@pytest.mark.parametrize(
    ("strategy", "model", "extra"),
    [
        ("ddp", "micro", ["train.max_steps=2"]),  # LoRA, against the eager single-process reference
        # QLoRA's NF4 projections and the pipeline's stages, with dynamo alone (the `eager` backend),
        # without AOT autograd's cost (tests/model/test_compile.py takes QLoRA blocks through it)
        ("fsdp", "llama-micro", [*QLORA, "train.max_steps=1", "model.compile_backend=eager"]),
        (
            "pp",
            "mistral-micro",
            [
                "parallel.schedule=1f1b",
                "parallel.microbatches=2",
                "train.max_steps=1",
                "model.compile_backend=eager",
            ],
        ),
    ],
)
def test_compiled_layers_run_on_every_rank(strategy, model, extra, reference, tmp_path):
    out = tmp_path / strategy
    settings = [*PARITY, "--model", model, *COMPILED, *extra]  # the last --model wins
    proc = distft("train", "--strategy", strategy, "--nproc", "2", *settings, "--out", str(out))

    ranks = json.loads((out / "ranks.json").read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["compiled_graphs"] > 0, r
        assert r["attention"] == "flex" and "compile_fallback" not in r
        # One graph per variant for every layer (the first one's input requires grad too), and
        # none for the evaluation, which runs the blocks eagerly instead of compiling them again.
        assert r["recompiles"] == 0, r
    records = metrics(out)
    assert all(m["compiled_graphs"] > 0 and m["attention"] == "flex" for m in records)
    assert all(m["comm_bytes"] for m in records)  # measured while compiled
    assert "decoder layers to compile with " in proc.stdout  # the header's promise
    assert "compiled decoder layers:" in proc.stdout  # what step 1 compiled
    assert "rank 1: " in proc.stdout and "no graph compiled" not in proc.stdout
    if strategy == "ddp":  # bucketed rows, per-document attention: the reference's first two steps
        for got, want in zip(records, metrics(reference)[:2], strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)


def test_an_eager_run_never_says_compiled(tmp_path):
    proc = distft("train", *PARITY, "train.max_steps=1", "--out", str(tmp_path))
    assert "compiled decoder layers" not in proc.stdout
    assert "eager (model.compile=auto)" in proc.stdout and "no graph compiled (eager)" in proc.stdout
    (record,) = metrics(tmp_path)
    assert record["compiled_graphs"] == 0 and record["attention"] == "flex"
