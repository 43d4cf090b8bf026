"""What trains beside LoRA's adapters (`distft.model.tokens`): `lora.modules_to_save` and the rows
of `model.added_tokens`.

One run in this process (`llama-micro`, untied: the embedding trains whole, lm_head's rows of the
added tokens through peft's trainable tokens; 301 added tokens, so the 4,096-row embedding grows)
is checked for what it saved, what `distft infer` and plain peft load, and what `distft export`
merges; one 2-rank FSDP run on the same global batch must train the same. The refusals before
launch run as dry runs.
"""

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from distft.cli import main
from distft.config import load_config
from distft.data.cache import cache_key
from distft.data.tokenizer import qwen3_tokenizer, special_token_ids, tokenizer_fingerprint, with_added_tokens
from distft.infer import load_trained
from distft.model import apply_method, load_base_model, peft_quietly
from distft.model.presets import MICRO_RANKS
from tests.helpers import PARITY, adapter, assert_same_training, distft

ADDED = [f"<|tag{i}|>" for i in range(300)] + ["<|speaker|>"]
VOCAB = len(special_token_ids(MICRO_RANKS)) + MICRO_RANKS  # the micro presets' tokenizer's length
ROWS = VOCAB + len(ADDED)  # > the presets' 4,096 embedding rows: the embedding grows
SPEAKER = ROWS - 1  # the last token added
EMBED = "base_model.model.model.embed_tokens.weight"  # the trained copy (lora.modules_to_save)
HEAD_ROWS = "base_model.model.lm_head.token_adapter.trainable_tokens_delta"  # the added tokens' rows


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    """The run's command line: PARITY's batch on rows that use the added tokens."""
    tmp = tmp_path_factory.mktemp("tokens")
    data = tmp / "rows.jsonl"
    data.write_text("".join(
        json.dumps({"prompt": f"<|speaker|> A: item {i} <|tag{i}|> is due", "completion": f"<|speaker|> noted {i}"}) + "\n"
        for i in range(32)
    ))  # fmt: skip
    config = tmp / "run.toml"
    config.write_text(
        f'[model]\nadded_tokens = {json.dumps(ADDED)}\n[lora]\nmodules_to_save = ["embed_tokens"]\n'
    )
    return [*PARITY, "--model", "llama-micro", "--data", str(data), "--config", str(config)]


@pytest.fixture(scope="module")
def run(args, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    assert main(["train", *args, "--out", str(out)]) == 0  # in this process
    return out


def test_the_tokens_are_added_and_the_embedding_grows(run):
    tokenizer = AutoTokenizer.from_pretrained(
        run / "base"
    )  # what the run tokenised with, saved beside its base
    assert len(tokenizer) == ROWS and tokenizer.convert_tokens_to_ids("<|speaker|>") == SPEAKER
    assert tokenizer.encode("A<|speaker|> ok")[1] == SPEAKER  # one token, not its pieces
    loaded = load_trained(run=str(run))
    assert loaded.tokenizer.convert_tokens_to_ids(ADDED) == list(range(VOCAB, ROWS))
    model = loaded.model.get_base_model()
    assert model.get_input_embeddings().weight.shape[0] == ROWS == model.config.vocab_size


def test_the_adapter_holds_the_trained_module_and_rows(run):
    trained, base = adapter(run), load_file(run / "base" / "model.safetensors")
    assert trained[EMBED].shape == (ROWS, 32) and trained[HEAD_ROWS].shape == (len(ADDED), 32)
    old = base["model.embed_tokens.weight"]  # 4,096 rows: the base as saved, not grown
    changed = (trained[EMBED][: len(old)] != old).any(dim=1)
    assert changed.any() and not changed.all()  # the rows of the tokens the data holds
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["model.embed_tokens"]
    assert config["trainable_token_indices"] == {"lm_head": list(range(VOCAB, ROWS))}


def test_infer_plain_peft_and_export_compute_the_same(run, tmp_path):
    """The adapter alone decides the added rows: plain peft on the base grown any which way, and
    the merged export, compute what `distft infer` loads."""
    ids = torch.tensor([[3707, SPEAKER, 1879, VOCAB + 5, 13]])
    loaded = load_trained(run=str(run)).model
    base = AutoModelForCausalLM.from_pretrained(run / "base")
    base.resize_token_embeddings(ROWS, mean_resizing=False)  # other new rows than training drew
    with peft_quietly():
        plain = PeftModel.from_pretrained(base, run / "adapter").eval()
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "export"), "--dtype", "float32"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert merged.config.vocab_size == ROWS
    with torch.no_grad():
        want = loaded(input_ids=ids).logits
        torch.testing.assert_close(plain(input_ids=ids).logits, want, rtol=0, atol=0)
        torch.testing.assert_close(
            merged(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5
        )  # merged: rounded once


def test_fsdp_on_two_ranks_trains_what_one_process_does(run, args, tmp_path):
    out = tmp_path / "fsdp"
    distft("train", "--strategy", "fsdp", "--nproc", "2", *args, "--out", str(out))
    assert_same_training(out, run)  # losses, grad norms and every adapter tensor
    # The embedding's update, not its whole (which the untouched rows dominate), to the same
    # standard: the copy is sharded, gathered and reduce-scattered like the base under FSDP.
    base = load_file(run / "base" / "model.safetensors")["model.embed_tokens.weight"]
    got, want = adapter(out)[EMBED][: len(base)] - base, adapter(run)[EMBED][: len(base)] - base
    assert (got - want).norm() <= 1e-5 * want.norm()


def test_the_added_tokens_are_in_the_token_cache_key():
    cfg = load_config(None, [])
    shared = qwen3_tokenizer(MICRO_RANKS)
    added = with_added_tokens(shared, ["<|speaker|>", "<think>"])  # <think> is Qwen's already
    assert len(shared) == VOCAB and len(added) == VOCAB + 1  # the shared tokenizer is untouched
    assert added.convert_tokens_to_ids("<think>") == shared.convert_tokens_to_ids("<think>")
    assert with_added_tokens(added, ["<|speaker|>"]) is added  # nothing left to add: no copy
    assert tokenizer_fingerprint(added) != tokenizer_fingerprint(shared)
    assert cache_key(cfg.data, 0, added)["tokenizer"] != cache_key(cfg.data, 0, shared)["tokenizer"]


def test_a_module_name_is_one_module_and_a_tied_pair_stays_tied():
    """peft matches the end of a module path's text: `norm` is passed as model.norm, so no
    layernorm trains. A tied embedding / lm_head trains one copy, and its added rows one delta."""
    cfg = load_config(
        None, ["model.name=micro", 'lora.modules_to_save=["norm"]', 'model.added_tokens=["<|x|>"]']
    )
    torch.manual_seed(0)
    lm = apply_method(
        load_base_model(cfg.model), cfg, with_added_tokens(qwen3_tokenizer(MICRO_RANKS), ["<|x|>"])
    )
    extra = {n for n, p in lm.named_parameters() if p.requires_grad and "lora_" not in n}
    assert extra == {
        "base_model.model.model.norm.modules_to_save.default.weight",
        "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta.default",
    }
    inner = lm.get_base_model()
    assert inner.lm_head.weight.shape == inner.get_input_embeddings().weight.shape  # tied: the same rows


DRY = ["train", "--model", "micro", "data.max_rows=8", "--dry-run"]


@pytest.mark.parametrize(
    ("argv", "start", "end"),
    [
        (
            ["--strategy", "pp", "--nproc", "2", 'lora.modules_to_save=["embed_tokens"]'],
            "lora.modules_to_save cannot run with --method lora under --strategy pp, which puts the embedding",
            "it runs with single, ddp, zero1, zero2, fsdp, hsdp, tp, tp-sp, cp, fsdp+tp, fsdp+cp, fsdp+ep, hsdp+tp.",
        ),
        (
            ['lora.modules_to_save=["embed_token"]'],
            "`lora.modules_to_save` names embed_token, which micro does not have",
            "Did you mean `embed_tokens`?",
        ),
        (
            ['lora.modules_to_save=["q_proj"]'],
            "`lora.modules_to_save` names q_proj, which is trained through a LoRA adapter",
            "(or from lora.target_modules).",
        ),
    ],
)
def test_what_cannot_run_is_refused_before_launch_in_one_line(argv, start, end, tmp_path, capsys):
    assert main([*DRY, *argv, "--out", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"distft train: error: {start}") and line.endswith(end), line
