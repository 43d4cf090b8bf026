"""`lora.init_adapter`: a trained adapter as a run's starting point, e.g. the SFT adapter that a
preference objective then trains further (docs/preference.md, "Starting from an adapter").

The adapter's weights are loaded into the run's own freshly built adapters (same names, same
shapes), so everything else is as in any run: the strategy wraps the model, the optimizer starts
afresh, and the exported adapter is a plain PEFT adapter of the same base. What must agree is
checked before launch (`check_init_adapter`), and every adapter tensor must find its place when
loaded (`load_init_adapter`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from distft.config import Config, lora_target_names
from distft.errors import ConfigError

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def adapter_directory(path: str) -> Path:
    """The adapter directory `path` names: itself, or a run directory's adapter/."""
    directory = Path(path)
    return directory / "adapter" if (directory / "adapter").is_dir() else directory


def check_init_adapter(cfg: Config) -> None:
    """Before launch: lora.init_adapter holds a safetensors adapter whose settings are the run's."""
    if not cfg.lora.init_adapter:
        return
    if cfg.train.method == "full":
        raise ConfigError(
            "lora.init_adapter starts LoRA from a trained adapter; --method full trains no adapter."
        )
    directory = adapter_directory(cfg.lora.init_adapter)
    missing = [name for name in ADAPTER_FILES if not (directory / name).is_file()]
    if missing:
        raise ConfigError(
            f"lora.init_adapter={cfg.lora.init_adapter}: no {' or '.join(missing)} in {directory} (a run "
            "directory, or a PEFT adapter directory saved as safetensors)."
        )
    saved = json.loads((directory / "adapter_config.json").read_text())
    wanted = {
        "r": ("lora.rank", cfg.lora.rank),
        "lora_alpha": ("lora.alpha", cfg.lora.alpha),
        "use_dora": ("lora.variant=dora", cfg.lora.variant == "dora"),
        "use_rslora": ("lora.variant=rslora", cfg.lora.variant == "rslora"),
    }
    if cfg.lora.target_modules != ["all-linear"]:
        wanted["target_modules"] = ("lora.target_modules", sorted(lora_target_names(cfg.lora.target_modules)))
        saved["target_modules"] = sorted(saved.get("target_modules") or [])
    for key, (setting, value) in wanted.items():
        if saved.get(key) != value:
            raise ConfigError(
                f"lora.init_adapter={cfg.lora.init_adapter} was trained with {key}={saved.get(key)!r}, this "
                f"run asks {setting} = {value!r}: set it as the adapter has it."
            )


def load_init_adapter(model: Any, path: str) -> None:
    """The adapter's weights as `model`'s own (a PeftModel, its adapters built with the same settings)."""
    from peft import set_peft_model_state_dict  # a train's ranks only: the CLI's checks import no peft
    from safetensors.torch import load_file

    weights = load_file(adapter_directory(path) / "adapter_model.safetensors")
    result = set_peft_model_state_dict(model, weights)
    unplaced = list(result.unexpected_keys)
    missing = [k for k in result.missing_keys if "lora_" in k]  # the base's own are not the adapter's
    if unplaced or missing:
        raise ConfigError(
            f"lora.init_adapter={path} does not fit this run's adapters: "
            + (f"{len(unplaced)} of its tensors have no place (e.g. {unplaced[0]})" if unplaced else "")
            + ("; " if unplaced and missing else "")
            + (f"{len(missing)} adapter tensors get no value (e.g. {missing[0]})" if missing else "")
            + ". Was it trained on another model?"
        )
