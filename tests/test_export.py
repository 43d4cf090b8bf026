"""`distft export`: a trained run becomes one plain transformers model, tokenizer and model card.

Each run here is `micro` trained for 2 steps in this process; the export goes through the CLI's
`main`, and is loaded back with nothing but transformers.
"""

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from distft.cli import main
from distft.config import load_config
from distft.data.tokenizer import qwen3_tokenizer
from distft.infer import load_trained
from distft.model.presets import MICRO_RANKS
from distft.train import train

SHORT = [
    "model.name=micro",
    "train.max_steps=2",
    "train.global_batch_size=2",
    "train.micro_batch_size=2",
    "train.eval_batches=1",
    "data.max_length=384",
    "data.max_rows=8",
    "optim.lr=1e-2",
    "optim.warmup_steps=1",
]
IDS = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))


def trained(tmp_path_factory, method: str):
    run = tmp_path_factory.mktemp(method)
    result = train(load_config(None, [*SHORT, f"train.method={method}", f"output.dir={run}"]))
    return run, result.model.lm.eval()


def export(run, out, *flags: str) -> int:
    return main(["export", "--run", str(run), "--out", str(out), *flags])


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    run, peft_model = trained(tmp_path_factory, "lora")
    out = run.parent / "lora-export"
    assert export(run, out, "--dtype", "float32") == 0
    return run, peft_model, out


def test_lora_export_equals_the_peft_model(lora):
    """The merged model computes x (W + s B A)^T where the PeftModel computes x W^T + s (x A^T) B^T:
    the same function in float32, rounded in another order (measured: 3e-6 at most, on logits up to
    ~3). 1e-4 absolute leaves room for that rounding and nothing else: the adapter itself moves the
    logits by ~1e-1 (asserted below), so a merge that lost or doubled it would fail."""
    run, peft_model, out = lora
    model = AutoModelForCausalLM.from_pretrained(out)
    assert not hasattr(model, "peft_config") and model.dtype == torch.float32
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run / "base"), run / "adapter")
    expected = logits(peft_model)
    torch.testing.assert_close(logits(reloaded.eval()), expected, rtol=0, atol=0)
    torch.testing.assert_close(logits(model), expected, rtol=0, atol=1e-4)
    with peft_model.disable_adapter():
        base = logits(peft_model)
    assert (base - expected).abs().max() > 1e-2, "the adapter changes the model, so the merge is tested"


def test_tokenizer_and_chat_template_round_trip(lora):
    _, _, out = lora
    tokenizer, original = AutoTokenizer.from_pretrained(out), qwen3_tokenizer(MICRO_RANKS)
    text = "Anna: the budget is 1,250 euros.\nBen: agreed — ship it on Friday. <|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == original.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.chat_template and tokenizer.chat_template == original.chat_template
    messages = [{"role": "system", "content": "Summarize."}, {"role": "user", "content": text}]
    assert tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    ) == original.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    generation = json.loads((out / "generation_config.json").read_text())
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in generation["eos_token_id"]


def test_model_card_reports_the_run(lora):
    run, _, out = lora
    card = (out / "README.md").read_text()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert card.startswith("---\n") and "library_name: transformers" in card
    assert "| method | lora |" in card and "`micro` preset" in card
    assert f"| final training loss (step 2) | {records[-1]['loss']:.4f} |" in card
    assert f"| final validation loss | {records[-1]['eval_loss']:.4f} |" in card
    assert f"AutoModelForCausalLM.from_pretrained('{out}')" in card


def test_bfloat16_export_is_the_float32_one_rounded_once(lora, tmp_path):
    run, _, out32 = lora
    assert export(run, tmp_path / "bf16") == 0  # bfloat16 is the default
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    half, full = load_file(tmp_path / "bf16" / "model.safetensors"), load_file(out32 / "model.safetensors")
    assert half.keys() == full.keys()
    for name, tensor in half.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, full[name].to(torch.bfloat16)), name


def test_full_finetune_writes_its_tokenizer_and_exports(tmp_path_factory):
    run, lm = trained(tmp_path_factory, "full")
    assert (run / "model" / "tokenizer.json").is_file() and (run / "model" / "chat_template.jinja").is_file()
    assert AutoTokenizer.from_pretrained(run / "model").chat_template
    out = run.parent / "full-export"
    assert export(run, out, "--dtype", "float32") == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(logits(model), logits(lm), rtol=0, atol=0)  # no merge: the same weights
    assert AutoTokenizer.from_pretrained(out).chat_template
    assert "| method | full |" in (out / "README.md").read_text()


def test_qlora_merges_onto_the_dequantized_base(tmp_path_factory):
    """The QLoRA adapter was trained on NF4 weights; `load_trained` rebuilds that base (dequantized),
    and the export must equal it with the adapter on top (tolerance as for LoRA)."""
    run, _ = trained(tmp_path_factory, "qlora")
    out = run.parent / "qlora-export"
    assert export(run, out, "--dtype", "float32") == 0
    expected = logits(load_trained(run=str(run)).model)
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(out)), expected, rtol=0, atol=1e-4)
    assert "4-bit NF4 base" in (out / "README.md").read_text()


# ---- errors: one paragraph, exit code 2, nothing written -------------------------------------------


def assert_refused(capsys, args: list[str], *phrases: str) -> None:
    assert main(["export", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("distft export: error: ") and err.count("\n") == 1, err
    for phrase in phrases:
        assert phrase in err, err


def test_errors_are_one_paragraph(lora, tmp_path, capsys):
    run, _, _ = lora
    assert_refused(
        capsys, ["--run", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")], "no config.toml"
    )
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "config.toml").write_text((run / "config.toml").read_text())
    assert_refused(
        capsys, ["--run", str(unfinished), "--out", str(tmp_path / "o")], "has not finished", "--resume"
    )
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    assert_refused(capsys, ["--run", str(run), "--out", str(stranger)], "already holds files")
    assert (stranger / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "o").exists()


def test_push_without_a_login_is_refused_before_any_work(lora, tmp_path, capsys, monkeypatch):
    import huggingface_hub

    run, _, _ = lora
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    out = tmp_path / "o"
    assert_refused(capsys, ["--run", str(run), "--out", str(out), "--push-to-hub", "me/x"], "hf auth login")
    assert not out.exists()


def test_push_to_hub_uploads_the_export(lora, tmp_path, monkeypatch):
    """Only the network calls are replaced: HfApi.create_repo and upload_folder record their arguments
    and what the folder holds at upload time."""
    import huggingface_hub
    from huggingface_hub import HfApi

    run, _, _ = lora
    calls = {}

    def create_repo(self, repo_id, **kwargs):
        calls["create_repo"] = {"repo_id": repo_id, **kwargs}
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kwargs):
        calls["upload_folder"] = {**kwargs, "files": sorted(p.name for p in tmp_path.joinpath("o").iterdir())}

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_test")
    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    assert export(run, tmp_path / "o", "--push-to-hub", "me/meeting-summaries", "--private") == 0
    assert calls["create_repo"]["repo_id"] == "me/meeting-summaries"
    assert calls["create_repo"]["private"] is True and calls["create_repo"]["exist_ok"] is True
    upload = calls["upload_folder"]
    assert upload["repo_id"] == "me/meeting-summaries" and upload["folder_path"] == str(tmp_path / "o")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "README.md"):
        assert name in upload["files"], upload["files"]
    assert "from_pretrained('me/meeting-summaries')" in (tmp_path / "o" / "README.md").read_text()


def test_the_card_reads_what_it_can_of_a_damaged_metrics_file(tmp_path):
    from distft.export import final_losses

    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 2.5}\nnot json\n[3]\n{"step": 2, "loss": 2.0, "eval_loss": 1.9}\n{"st'
    )
    assert final_losses(tmp_path) == {"step": 2, "loss": 2.0, "eval_loss": 1.9}
