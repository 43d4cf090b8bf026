"""The Python API of docs/python-api.md: a Config object, an in-memory dataset, two steps."""

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from distft.config import load_config
from distft.data.rows import memory_source
from distft.errors import DataError
from distft.train import TrainResult, train

ROWS = [
    {
        "messages": [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": f"What is {i} plus {i}?"},
            {"role": "assistant", "content": str(2 * i)},
        ]
    }
    for i in range(12)
]


def test_train_from_a_notebook(tmp_path):
    cfg = load_config(
        None,
        [
            "model.name=micro",
            "train.max_steps=2",
            "train.global_batch_size=2",
            "train.micro_batch_size=2",
            "train.eval_batches=1",
            "data.max_length=128",
            f"output.dir={tmp_path / 'run'}",
        ],
    )
    result = train(cfg, dataset=ROWS)
    assert isinstance(result, TrainResult)
    assert len(result.losses) == 2 and all(torch.isfinite(torch.tensor(result.losses)))
    assert list(result.eval_losses) == [2]
    assert result.output_dir == tmp_path / "run"
    # The rows are named by their count and content in the config, not as the bundled sample.
    source = load_config(result.output_dir / "config.toml").data.source
    assert source == memory_source(ROWS) and source.startswith("memory:12 rows:")
    assert json.loads((result.output_dir / "lineage.json").read_text())["stages"][0]["data"] == source
    # The adapter loads on the saved base like any PEFT adapter and reproduces the trained model.
    base = AutoModelForCausalLM.from_pretrained(result.output_dir / "base")
    loaded = PeftModel.from_pretrained(base, result.output_dir / "adapter").eval()
    ids = torch.randint(0, 1000, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, result.model.lm.eval()(input_ids=ids).logits)


def test_a_bad_in_memory_row_is_named(tmp_path):
    cfg = load_config(None, ["model.name=micro", f"output.dir={tmp_path / 'run'}"])
    with pytest.raises(DataError, match=r"dataset\[3\]: the chat has no assistant turn"):
        train(cfg, dataset=[*ROWS[:3], {"messages": [{"role": "user", "content": "Hi"}]}, *ROWS[4:]])
