"""Every family's run serves: `distft export` merges it into a model that plain transformers loads
and generates with, stopping at the end-of-turn token of its chat template, and `distft infer`
answers on the run itself. One one-step run per family serves both."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
)

from distft.data import end_of_turn
from distft.export import stop_on_end_of_turn
from tests.chat_templates import styled_tokenizer
from tests.helpers import distft

TRAIN = [
    "train.max_steps=1",
    "train.global_batch_size=2",
    "train.micro_batch_size=1",
    "data.max_length=256",
    "data.max_rows=8",
    "train.eval_every=0",
]


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def run(request, tmp_path_factory):
    """(family, a finished one-step run of its micro preset, that run merged by `distft export`)."""
    root = tmp_path_factory.mktemp(request.param)
    distft("train", "--model", f"{request.param}-micro", *TRAIN, "--out", str(root / "run"))
    distft("export", "--run", str(root / "run"), "--out", str(root / "export"))
    return request.param, root / "run", root / "export"


class EndOfTurnAt(LogitsProcessor):
    """Makes the model write `token` as its `step`-th new token: where generation must stop."""

    def __init__(self, prompt_length: int, step: int, token: int):
        self.at, self.token = prompt_length + step - 1, token

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] == self.at:
            scores = torch.full_like(scores, -torch.inf)
            scores[:, self.token] = 0.0
        return scores


def test_the_merged_export_generates_with_plain_transformers(run):
    family, _, export = run
    model = AutoModelForCausalLM.from_pretrained(export)  # no peft, no distft
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert model.config.model_type == family
    end = end_of_turn(tokenizer).id  # a preset's template is Qwen3's: <|im_end|>
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"][0] == end
    chat = [{"role": "user", "content": "Summarise: we ship on Friday."}]
    ids = tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    prompt = ids["input_ids"].shape[1]
    with torch.no_grad():
        free = model.generate(**ids, max_new_tokens=4, do_sample=False)
        stopped = model.generate(
            **ids, max_new_tokens=8, do_sample=False, logits_processor=LogitsProcessorList([EndOfTurnAt(prompt, 3, end)])
        )  # fmt: skip
    assert free.shape[1] <= prompt + 4
    assert stopped.shape[1] == prompt + 3 and stopped[0, -1].item() == end  # its own config stops it


def test_infer_answers_on_the_run(run):
    _, run_dir, _ = run
    proc = distft("infer", "--run", str(run_dir), "--max-new-tokens", "4")
    assert "generated summary" in proc.stdout


def test_an_export_stops_at_its_own_templates_end_of_turn():
    """A real checkpoint's tokenizer names its own end of turn (Llama 3's), first among the stop ids."""
    tokenizer = styled_tokenizer("llama3")

    class Model:
        generation_config = GenerationConfig(
            eos_token_id=tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
        )

    stops = stop_on_end_of_turn(Model(), tokenizer)
    assert stops == [
        tokenizer.convert_tokens_to_ids(t) for t in ("<|eot_id|>", "<|begin_of_text|>", "<|endoftext|>")
    ]
