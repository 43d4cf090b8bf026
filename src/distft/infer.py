"""Inference and evaluation with a trained run: load base + adapter, summarise, score.

Loading knows nothing about how the run was trained: every strategy exports the same PEFT adapter
(or, for full finetuning, the same transformers checkpoint), so this is the plain
`PeftModel.from_pretrained` path a user would write by hand. A QLoRA adapter says so in its
`quantization.json`: its base is quantized to NF4 and dequantized the same way first
(`distft.model.nf4.dequantize_base`), so the adapter sits on the weights it was trained against.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from distft.config import Config, load_config
from distft.data import ChatFormatter, collate, count_label_tokens, load_rows, tokenize_rows
from distft.data.tokenizer import load_tokenizer
from distft.errors import ConfigError
from distft.model import DTYPES, SummaryLM, causal_lm, is_preset, load_base_model
from distft.model.build import RECIPE_FILE, rebuild_base
from distft.model.nf4 import QUANTIZATION_FILE, NF4Spec, dequantize_base


@dataclass
class Loaded:
    model: nn.Module  # PeftModel (adapter) or a causal LM (full finetune / base only)
    tokenizer: object
    cfg: Config
    has_adapter: bool


def _load_base(name: str, cfg: Config) -> nn.Module:
    """The base an adapter sits on: a directory of weights, a run's DIR/base holding only a preset's
    recipe (rebuilt bit for bit, `distft.model.build.rebuild_base`), a preset or a hub id."""
    recipe = Path(name) / RECIPE_FILE
    if recipe.is_file() and not (Path(name) / "config.json").is_file():
        return rebuild_base(json.loads(recipe.read_text()))
    if Path(name).is_dir():
        return AutoModelForCausalLM.from_pretrained(name, dtype=DTYPES[cfg.model.dtype])
    cfg.model.name = name
    return load_base_model(cfg.model)


def load_trained(run: str | None = None, adapter: str | None = None, model: str | None = None) -> Loaded:
    """A run directory, or an adapter directory (+ optional base model override)."""
    from peft import PeftModel

    if run:
        run_dir = Path(run)
        if not (run_dir / "config.toml").is_file():
            raise ConfigError(
                f"{run_dir} is not a distft run directory (no config.toml). Train one with `distft train --out {run_dir}`."
            )
        cfg = load_config(run_dir / "config.toml")
        if (run_dir / "model").is_dir():  # full finetune
            lm = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=DTYPES[cfg.model.dtype])
            return Loaded(lm.eval(), _tokenizer_for(run_dir, cfg), cfg, has_adapter=False)
        adapter = adapter or str(run_dir / "adapter")
        base_name = model or (str(run_dir / "base") if (run_dir / "base").is_dir() else cfg.model.name)
        tokenizer = _tokenizer_for(run_dir, cfg)
    else:
        if not adapter:
            raise ConfigError("Give --run DIR or --adapter DIR.")
        config_path = Path(adapter) / "adapter_config.json"
        if not config_path.is_file():
            raise ConfigError(f"{adapter} is not a PEFT adapter directory (no adapter_config.json).")
        cfg = load_config()
        base_name = model or json.loads(config_path.read_text())["base_model_name_or_path"]
        tokenizer = load_tokenizer(
            base_name if Path(base_name).is_dir() or not is_preset(base_name) else None
        )
    if not (Path(adapter) / "adapter_config.json").is_file():
        raise ConfigError(f"No adapter in {adapter}: the run has not finished, or it was a full finetune.")
    base = _load_base(base_name, cfg)
    quant_file = Path(adapter) / QUANTIZATION_FILE
    if quant_file.is_file():  # a QLoRA adapter: rebuild the 4-bit base it was trained on
        spec = json.loads(quant_file.read_text())
        dequantize_base(
            causal_lm(base).model.layers,
            NF4Spec(spec["block_size"], spec["scaler_block_size"], spec["double_quant"]),
        )
    lm = PeftModel.from_pretrained(base, adapter)
    return Loaded(lm.eval(), tokenizer, cfg, has_adapter=True)


def _tokenizer_for(run_dir: Path, cfg: Config):
    if (run_dir / "base" / "tokenizer.json").is_file():
        return load_tokenizer(str(run_dir / "base"))
    return load_tokenizer(None if is_preset(cfg.model.name) else cfg.model.name)


@torch.no_grad()
def summarize(loaded: Loaded, transcript: str, max_new_tokens: int = 128) -> str:
    formatter = ChatFormatter(loaded.tokenizer, loaded.cfg.data)
    prompt = torch.tensor([formatter.prompt_ids(transcript, reserve=max_new_tokens)])
    output = loaded.model.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        use_cache=True,
        eos_token_id=formatter.end_id,
        pad_token_id=loaded.tokenizer.pad_token_id,
    )
    return loaded.tokenizer.decode(output[0, prompt.shape[1] :], skip_special_tokens=True).strip()


def held_out_meeting(cfg: Config) -> str:
    """The first validation meeting of the run's dataset (never seen in training)."""
    return load_rows(cfg.data, seed=cfg.train.seed)["validation"][0].transcript


@torch.no_grad()
def validation_loss(model: nn.Module, loaded: Loaded, max_rows: int) -> float:
    formatter = ChatFormatter(loaded.tokenizer, loaded.cfg.data)
    rows = load_rows(loaded.cfg.data, seed=loaded.cfg.train.seed)["validation"][:max_rows]
    examples = tokenize_rows(rows, formatter).examples
    head = SummaryLM(model)
    loss, n = 0.0, 0
    mb = loaded.cfg.train.micro_batch_size
    for i in range(0, len(examples), mb):
        batch = examples[i : i + mb]
        loss += head(**collate(batch, loaded.tokenizer.pad_token_id)).item()
        n += count_label_tokens(batch)
    return loss / n


def evaluate_run(run: str, max_rows: int = 16, max_new_tokens: int = 96) -> dict[str, dict[str, float]]:
    """Validation loss and ROUGE-L of the base model vs the finetuned one."""
    from rouge_score import rouge_scorer

    loaded = load_trained(run=run)
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    rows = load_rows(loaded.cfg.data, seed=loaded.cfg.train.seed)["validation"][:max_rows]

    def score() -> dict[str, float]:
        loss = validation_loss(loaded.model, loaded, max_rows)
        rouge = [
            scorer.score(r.summary, summarize(loaded, r.transcript, max_new_tokens))["rougeL"].fmeasure
            for r in rows
        ]
        return {"loss": loss, "rougeL": sum(rouge) / len(rouge)}

    finetuned = score()
    if loaded.has_adapter:
        with loaded.model.disable_adapter():
            base = score()
    else:
        base_model = _load_base(
            str(Path(run) / "base") if (Path(run) / "base").is_dir() else loaded.cfg.model.name, loaded.cfg
        ).eval()
        loaded = Loaded(base_model, loaded.tokenizer, loaded.cfg, False)
        base = score()
    return {"base": base, "finetuned": finetuned}
