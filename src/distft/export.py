"""`distft export`: a finished run as one plain transformers model, with its tokenizer and card.

A LoRA run holds an adapter on a base; serving it wants one model. `export_run` loads the run the
way `distft infer` does (`distft.infer.load_trained`: the base, the QLoRA base rebuilt and
dequantized when the adapter was trained on NF4, the adapter on top), folds the adapter into the
base weights (`PeftModel.merge_and_unload`: W <- W + (alpha / r) B A), casts to `--dtype` and
writes config.json + safetensors, the tokenizer with its chat template, and a model card
(`README.md`) built from the run's config.toml and metrics.jsonl. A full finetune is already one
model: it is cast and written the same way. The result loads with
`AutoModelForCausalLM.from_pretrained(OUT)` and `AutoTokenizer.from_pretrained(OUT)`, no peft and
no distft needed. `--push-to-hub REPO` then uploads the directory with `huggingface_hub.HfApi`.

Every check (a run directory, a finished run, a usable output directory, a hub login) happens
before any weight is loaded, each a one-paragraph `ConfigError`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from distft.commands.export import EXPORT_DTYPES
from distft.config import Config, load_config
from distft.data import SummaryRow, data_name, end_of_turn, validation_rows
from distft.data.sample import SAMPLES, is_sample
from distft.errors import ConfigError, DataError
from distft.infer import load_trained
from distft.io.checkpoint import resume_hint
from distft.io.lineage import describe, is_random
from distft.io.preflight import check_output_path
from distft.io.save import save_merged_model
from distft.model import DTYPES, is_preset
from distft.text import plural

# ---- checks, before anything is loaded -----------------------------------------------------


def check_run(run_dir: Path) -> Config:
    """The run's config, once the directory is known to hold a finished run."""
    if not (run_dir / "config.toml").is_file():
        raise ConfigError(
            f"--run {run_dir} is not a distft run directory (no config.toml). Train one with "
            f"`distft train --out {run_dir}`, or point --run at the directory a run wrote."
        )
    cfg = load_config(run_dir / "config.toml", run=True)
    weights = run_dir / ("model/config.json" if cfg.train.method == "full" else "adapter/adapter_config.json")
    if not weights.is_file():
        raise ConfigError(
            f"--run {run_dir} has not finished: there is no {weights.relative_to(run_dir)}, which a run "
            f"writes after its last step. {resume_hint(run_dir)}"
        )
    return cfg


def check_out(out: Path, run_dir: Path) -> None:
    """`out` is new, empty, or an earlier export (replaced whole); never the run, a part of any run,
    a directory holding the run, or a stranger's files; and writable, before anything is loaded."""
    if out.resolve() == run_dir.resolve():
        raise ConfigError(f"--out {out} is the run directory itself; export into a directory of its own.")
    if out.resolve() in run_dir.resolve().parents:
        raise ConfigError(
            f"--out {out} holds the run {run_dir}, which the export would replace; give a new directory."
        )
    check_output_path(out, "--out", directory=True)
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise ConfigError(
            f"--out {out} already holds files and is not an earlier export (no config.json); an export "
            "replaces its directory whole, so give an empty or new directory."
        )


def check_hub(repo: str) -> None:
    """A valid repository id and a saved hub login (`hf auth login` or HF_TOKEN), checked offline."""
    from huggingface_hub import get_token
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as err:
        raise ConfigError(f"--push-to-hub {repo!r} is not a hub repository id (user/name): {err}") from None
    if get_token() is None:
        raise ConfigError(
            f"--push-to-hub {repo} needs a Hugging Face login, and none is saved on this machine. Run "
            "`hf auth login` (or set HF_TOKEN to a token with write access), then export again; the "
            "export itself needs no login, so leave out --push-to-hub to only write the directory."
        )


# ---- the model ---------------------------------------------------------------------------------


def merged_model(model: nn.Module, has_adapter: bool, dtype: str) -> nn.Module:
    """The trained model as a plain causal LM in `dtype`: the adapter, if any, folded into the base.

    The merge runs in float32 whenever the export is float32 (a bfloat16-trained base is widened
    first, so W + (alpha / r) B A is rounded once, not twice); a bfloat16 export merges in the
    base's own dtype and rounds the sum to bfloat16 once."""
    if dtype == "float32":
        model = model.float()
    if has_adapter:
        model = model.merge_and_unload()
    return model.to(DTYPES[dtype]).eval()


def stop_on_end_of_turn(model: nn.Module, tokenizer) -> list[int]:
    """`generate()` on the export stops at the end of the assistant's turn: the chat template's
    end-of-turn token (Qwen's `<|im_end|>`, Llama 3's `<|eot_id|>`, Mistral's `</s>`), the
    tokenizer's end of text and padding (Qwen's `<|endoftext|>`), and whatever a released
    checkpoint's generation_config.json names already (a preset base has no such file). Returns
    the ids it stops at."""
    config = model.generation_config
    try:
        turn = [end_of_turn(tokenizer).id]
    except ConfigError:  # no chat template: a model trained on plain text ends at end of text
        turn = []
    named = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    stops = [*turn, *named, tokenizer.eos_token_id, tokenizer.pad_token_id]
    config.eos_token_id = list(dict.fromkeys(i for i in stops if i is not None))  # in order, once
    config.pad_token_id = tokenizer.pad_token_id
    return config.eos_token_id


# ---- the model card ----------------------------------------------------------------------------


def final_losses(run_dir: Path) -> dict[str, float]:
    """The last step, its training loss, and the last validation loss, from metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    records = []
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a damaged line: the card shows what the others say
        if isinstance(record, dict) and "step" in record and "loss" in record:
            records.append(record)
    found: dict[str, float] = {}
    if records:
        found["step"], found["loss"] = records[-1]["step"], records[-1]["loss"]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    if evals:
        found["eval_loss"] = evals[-1]
    return found


def _base_line(cfg: Config) -> str:
    if is_preset(cfg.model.name):
        return (
            f"the `{cfg.model.name}` preset of distft, randomly initialised (an architecture, no hub weights)"
        )
    return f"`{cfg.model.name}`"


def _sentence(note: str) -> str:
    """ "note: this is ..." as a card's paragraph: "This is ..."."""
    text = note.removeprefix("note: ")
    return text[:1].upper() + text[1:]


def _settings(cfg: Config) -> list[str]:
    t, p = cfg.train, cfg.parallel
    rows = [
        (
            "method",
            t.method
            + (" (4-bit NF4 base, merged onto its dequantized weights)" if t.method == "qlora" else ""),
        ),
        ("strategy", f"{p.strategy} on {plural(cfg.world_size, 'process')}"),
        ("steps", f"{t.max_steps:,}"),
        ("global batch", f"{t.global_batch_size} sequences of up to {cfg.data.max_length} tokens"),
        ("learning rate", f"{cfg.optim.lr:g} (AdamW, {cfg.optim.warmup_steps} warm-up steps, cosine)"),
        ("trained in", cfg.model.dtype),
    ]
    if t.method != "full":
        rows.append(
            ("LoRA", f"r={cfg.lora.rank}, alpha={cfg.lora.alpha:g} on {', '.join(cfg.lora.target_modules)}")
        )
    return [f"| {name} | {value} |" for name, value in rows]


# What a run's data format makes of the model: the card's title, its one-line use, hub tags.
CARD_FORMATS = {
    "summary": (
        "meeting summaries",
        "a meeting transcript in, its summary out",
        ["summarization", "meetings"],
    ),
    "chat": ("chat", "a conversation in, the assistant's next turn out", ["conversational"]),
    "prompt_completion": ("prompt completion", "a prompt in, its completion out", []),
    "alpaca": ("instruction following", "an instruction (and its input) in, the response out", []),
    "unknown": ("finetuned", "a prompt in, the answer it was trained to give out", []),
}


def card_format(cfg: Config) -> str:
    """The run's data format: `data.format`, or (auto) what its held-out rows are; `unknown` when
    they cannot be read (rows handed to train() in memory, a file since moved)."""
    if cfg.data.format != "auto":
        return cfg.data.format
    try:
        (row,) = validation_rows(cfg.data, seed=cfg.train.seed, limit=1)
    except (DataError, OSError, ValueError):
        return "unknown"
    return "summary" if isinstance(row, SummaryRow) else "chat"


def _usage(cfg: Config, fmt: str) -> list[str]:
    """The chat messages of the card's snippet: a meeting's system prompt, instruction and
    transcript, as in training; for the other formats one user turn."""
    if fmt != "summary":
        return ['messages = [{"role": "user", "content": prompt}]']
    system = json.dumps(cfg.data.system_prompt)
    instruction = json.dumps(cfg.data.instruction + "\n\n")
    return [
        f'messages = [{{"role": "system", "content": {system}}},',
        f'            {{"role": "user", "content": {instruction} + transcript}}]',
    ]


def model_card(
    cfg: Config,
    run_dir: Path,
    dtype: str,
    where: str = "PATH_OR_REPO",
    lineage: dict | None = None,
    thinking: bool = True,
) -> str:
    """README.md of the export: hub metadata, what was trained on what (the whole chain from a
    random preset, `lineage`), the final losses, and how to load it from `where` (the hub
    repository or the directory). `thinking`: the chat template has Qwen3's thinking switch."""
    from huggingface_hub import ModelCardData

    hub_base = not is_preset(cfg.model.name) and not Path(cfg.model.name).is_dir()
    fmt = card_format(cfg)
    title, use, tags = CARD_FORMATS[fmt]
    meta = ModelCardData(
        base_model=cfg.model.name if hub_base else None,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["distft", *tags, cfg.train.method],
    )
    losses = final_losses(run_dir)
    data = (
        f"{SAMPLES[cfg.data.source].title} (`--data {cfg.data.source}`)"
        if is_sample(cfg.data.source) and not cfg.data.sources
        else f"`{data_name(cfg.data)}`"
    )
    result = (
        [f"| final training loss (step {losses['step']}) | {losses['loss']:.4f} |"]
        if "loss" in losses
        else []
    )
    if "eval_loss" in losses:
        result.append(f"| final validation loss | {losses['eval_loss']:.4f} |")
    return "\n".join(
        [
            f"---\n{meta.to_yaml()}\n---",
            "",
            f"# {run_dir.resolve().name}: {title}",
            "",
            f"Finetuned with distft from {_base_line(cfg)} on {data}: {use}. "
            "Exported with `distft export` as one plain transformers model "
            f"({dtype}){', the adapter merged into the base' if cfg.train.method != 'full' else ''}.",
            "",
            *([_sentence(describe(lineage)), ""] if is_random(lineage) else []),
            "## Training",
            "",
            "| setting | value |",
            "|---|---|",
            *_settings(cfg),
            *result,
            "",
            "## Use",
            "",
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f"model = AutoModelForCausalLM.from_pretrained({where!r})",
            f"tokenizer = AutoTokenizer.from_pretrained({where!r})",
            *_usage(cfg, fmt),
            "ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,"
            + (" enable_thinking=False," if thinking else ""),
            '                                    return_tensors="pt", return_dict=True)',
            "out = model.generate(**ids, max_new_tokens=128)",
            'print(tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))',
            "```",
            "",
        ]
    )


# ---- the command ---------------------------------------------------------------------------------


def export_run(
    run: str | Path,
    out: str | Path,
    dtype: str = "bfloat16",
    push_to_hub: str | None = None,
    private: bool = False,
) -> Path:
    """Merge, cast and write the run in `run` to `out` (and upload it to `push_to_hub`); returns `out`."""
    run_dir, out = Path(run), Path(out)
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: choose {' or '.join(EXPORT_DTYPES)}.")
    cfg = check_run(run_dir)
    check_out(out, run_dir)
    if push_to_hub:
        check_hub(push_to_hub)
    loaded = load_trained(run=str(run_dir))
    with torch.no_grad():
        model = merged_model(loaded.model, loaded.has_adapter, dtype)
    stop_on_end_of_turn(model, loaded.tokenizer)
    thinking = "enable_thinking" in (loaded.tokenizer.chat_template or "")
    card = model_card(cfg, run_dir, dtype, push_to_hub or str(out), loaded.lineage, thinking)
    save_merged_model(model, loaded.tokenizer, out, card, loaded.lineage)
    if push_to_hub:
        push(out, push_to_hub, private)
    return out


def push(out: Path, repo: str, private: bool) -> str:
    """Create the model repository (if new) and upload the export directory as one commit."""
    from huggingface_hub import HfApi

    api = HfApi()
    url = api.create_repo(repo, private=private, repo_type="model", exist_ok=True)
    api.upload_folder(repo_id=repo, folder_path=str(out), repo_type="model", commit_message="distft export")
    return str(url)
