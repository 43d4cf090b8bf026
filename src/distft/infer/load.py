"""Loading a trained run: its base model + adapter (or its fully finetuned model), and tokenizer.

Loading knows nothing about how the run was trained: every strategy exports the same PEFT adapter
(or, for full finetuning, the same transformers checkpoint), so this is the plain
`PeftModel.from_pretrained` path a user would write by hand. A QLoRA adapter says so in its
`quantization.json`: its base is quantized to NF4 and dequantized the same way first
(`distft.model.nf4.dequantize_base`), so the adapter sits on the weights it was trained against.

Every directory a run wrote is checked against its manifest before a byte of it is loaded
(`distft.io.files.verify_directory`), so a file cut short or altered is named, and a file that
fails to load anyway (a directory from before manifests, or not from distft) is named as well:
never a traceback from inside safetensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from torch import nn
from transformers import AutoModelForCausalLM

from distft.config import Config, load_config
from distft.data import data_name
from distft.data.tokenizer import load_tokenizer, with_added_tokens
from distft.errors import ConfigError, DamagedFileError
from distft.host_memory import keep_freed_memory
from distft.io.files import verify_directory
from distft.io.lineage import describe, is_random, read_lineage
from distft.model import DTYPES, causal_lm, is_preset, load_base_model, peft_quietly, tokenizer_ranks
from distft.model.build import RECIPE_FILE, rebuild_base
from distft.model.experts import read_adapters_directly
from distft.model.files import check_weight_files
from distft.model.nf4 import QUANTIZATION_FILE, NF4Spec, dequantize_base
from distft.model.tokens import fit_vocabulary
from distft.text import plural


@dataclass
class Loaded:
    model: nn.Module  # PeftModel (adapter) or a causal LM (full finetune / base only)
    tokenizer: object
    cfg: Config
    has_adapter: bool
    preset: str | None = None  # the preset the base was built from (randomly initialised), if any
    lineage: dict | None = (
        None  # where the model came from, then the runs that trained it (`distft.io.lineage`)
    )
    run: str | None = None  # the run directory it was loaded from


def preset_notice(loaded: Loaded) -> str | None:
    """The line a user must read before judging the output: a preset base knows no language."""
    if is_random(loaded.lineage):  # the whole chain: random preset, then each run that trained it
        return describe(loaded.lineage, loaded.run)
    if loaded.preset is None:
        return None
    return (
        f"note: the base model is the `{loaded.preset}` preset, randomly initialised and trained only "
        f"on the run's data ({plural(loaded.cfg.train.max_steps, 'step')} of {data_name(loaded.cfg.data)}); its output "
        "shows that the pipeline works, not what a pretrained Qwen3 writes. For real results train on a "
        "pretrained model (--model Qwen/Qwen3-0.6B, or a local directory)."
    )


def _load_base(name: str, cfg: Config) -> nn.Module:
    """The base an adapter sits on: a directory of weights, a run's DIR/base holding only a preset's
    recipe (rebuilt bit for bit, `distft.model.build.rebuild_base`), a preset or a hub id."""
    recipe = Path(name) / RECIPE_FILE
    if recipe.is_file() and not (Path(name) / "config.json").is_file():
        return rebuild_base(json.loads(recipe.read_text()))
    if Path(name).is_dir():  # safetensors only, unless the run allowed pickles (`model.build`)
        check_weight_files(replace(cfg.model, name=name))
        return AutoModelForCausalLM.from_pretrained(
            name,
            dtype=DTYPES[cfg.model.dtype],
            use_safetensors=None if cfg.model.allow_pickle_weights else True,
        )
    cfg.model.name = name
    return load_base_model(cfg.model)


def load_trained(run: str | None = None, adapter: str | None = None, model: str | None = None) -> Loaded:
    """A run directory, or an adapter directory (+ optional base model override), verified first."""
    from safetensors import SafetensorError

    keep_freed_memory()  # the model is loaded, and generates, on the CPU (`distft.host_memory`)
    written = [Path(run) / d for d in ("adapter", "model", "base")] if run else []
    for directory in [*written, *(Path(p) for p in (adapter, model) if p)]:
        if directory.is_dir():
            verify_directory(directory, "The directory", "Restore it from a copy, or train the run again.")
    try:
        return _load_trained(run, adapter, model)
    except ConfigError:
        raise
    except (SafetensorError, OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as err:
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        damaged = (
            ""
            if type(err) is OSError
            else (
                " A file in it is damaged, or was not written by distft. Restore it from a copy, or train "
                "the run again."
            )
        )
        raise DamagedFileError(
            f"{run or adapter} cannot be loaded ({type(err).__name__}: {text}).{damaged}"
        ) from None


def _load_trained(run: str | None, adapter: str | None, model: str | None) -> Loaded:
    from peft import PeftModel

    from_run = False  # an adapter whose base is a run's saved preset base (RUN/base)
    if run:
        run_dir = Path(run)
        if not (run_dir / "config.toml").is_file():
            raise ConfigError(
                f"{run_dir} is not a distft run directory (no config.toml). Train one with `distft train --out {run_dir}`."
            )
        cfg = load_config(run_dir / "config.toml", run=True)
        if (run_dir / "model").is_dir():  # full finetune
            lm = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=DTYPES[cfg.model.dtype])
            tokenizer = _tokenizer_for(run_dir, cfg)
            return Loaded(
                lm.eval(), tokenizer, cfg, False, _preset(cfg.model.name), read_lineage(run_dir), run
            )
        adapter = adapter or str(run_dir / "adapter")
        base_name = model or (str(run_dir / "base") if (run_dir / "base").is_dir() else cfg.model.name)
        tokenizer = _tokenizer_for(run_dir, cfg)
        lineage = read_lineage(model) if model else read_lineage(run_dir)
    else:
        if not adapter:
            raise ConfigError("Give --run DIR or --adapter DIR.")
        config_path = Path(adapter) / "adapter_config.json"
        if not config_path.is_file():
            raise ConfigError(f"{adapter} is not a PEFT adapter directory (no adapter_config.json).")
        base_name = model or json.loads(config_path.read_text())["base_model_name_or_path"]
        # A run's saved preset base (RUN/base) is described by that run's config.
        run_config = Path(base_name).parent / "config.toml"
        from_run = Path(base_name).name == "base" and run_config.is_file()
        cfg = load_config(run_config if from_run else None)
        lineage = read_lineage(Path(base_name).parent) if from_run else read_lineage(base_name)
        if (Path(adapter) / "tokenizer.json").is_file():  # saved with it: the run changed the base's
            tokenizer = load_tokenizer(adapter)
        else:
            preset = not Path(base_name).is_dir() and is_preset(base_name)
            tokenizer = load_tokenizer(None if preset else base_name, ranks=tokenizer_ranks(base_name))
        tokenizer = with_added_tokens(tokenizer, cfg.model.added_tokens)  # a run's model.added_tokens
    if not (Path(adapter) / "adapter_config.json").is_file():
        raise ConfigError(f"No adapter in {adapter}: the run has not finished, or it was a full finetune.")
    if not (Path(adapter) / "adapter_model.safetensors").is_file():  # peft would unpickle a .bin
        raise ConfigError(
            f"{adapter} holds no adapter_model.safetensors (distft reads adapter weights as safetensors "
            "only; a pickled adapter_model.bin is not loaded). Convert it once where you trust it: "
            "`PeftModel.from_pretrained(base, DIR).save_pretrained(NEW_DIR)` writes safetensors."
        )
    preset = _preset(cfg.model.name) if (run or from_run) and not model else _preset(base_name)
    base = _load_base(base_name, cfg)
    quant_file = Path(adapter) / QUANTIZATION_FILE
    if quant_file.is_file():  # a QLoRA adapter: rebuild the 4-bit base it was trained on
        spec = json.loads(quant_file.read_text())
        dequantize_base(
            causal_lm(base).model.layers,
            NF4Spec(spec["block_size"], spec["scaler_block_size"], spec["double_quant"]),
        )
    fit_vocabulary(causal_lm(base), tokenizer, cfg.model.seed)  # model.added_tokens: the rows they trained
    with peft_quietly():  # peft's own deprecation warning, not the user's concern
        lm = PeftModel.from_pretrained(base, adapter)
    read_adapters_directly(lm)  # an MoE's experts under grouped_lora, as in training
    return Loaded(lm.eval(), tokenizer, cfg, True, preset, lineage, run)


def _preset(name: str) -> str | None:
    return name if is_preset(name) and not Path(name).is_dir() else None


def _tokenizer_for(run_dir: Path, cfg: Config):
    """The run's tokenizer: saved beside a preset's base, else the model's; with the tokens the
    run added (model.added_tokens) and its data.chat_template, as training had them."""
    if (run_dir / "base" / "tokenizer.json").is_file():
        tokenizer = load_tokenizer(str(run_dir / "base"), chat_template=cfg.data.chat_template)
    else:
        model = None if is_preset(cfg.model.name) else cfg.model.name
        tokenizer = load_tokenizer(
            model, cfg.model.revision, cfg.data.chat_template, tokenizer_ranks(cfg.model.name)
        )
    return with_added_tokens(tokenizer, cfg.model.added_tokens)
