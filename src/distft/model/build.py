"""Building the model a run trains: the base (preset, local directory or hub id), then the method.

`--model` takes one of three things:
- a preset from `distft.model.presets.PRESETS`: an architecture, randomly initialised from
  `model.seed`, identically on every rank;
- a local directory with config.json + safetensors;
- a hub id, loaded with transformers (and failing with a clear message when offline).

`apply_method` then turns the base into what trains: LoRA adapters on a frozen base (peft), the
same on a 4-bit NF4 base (QLoRA, `distft.model.nf4`), or every weight (full finetuning); with
`model.fp8`, the decoder's Linear layers then matmul in float8 (`distft.model.fp8`).
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from distft.config import Config, ModelConfig, lora_target_names
from distft.config.choices import LORA_TARGET_PRESETS
from distft.errors import ConfigError, DamagedFileError
from distft.hub import hub_offline
from distft.model.attention import resolve_attention, transformers_name
from distft.model.experts import read_adapters_directly, use_experts
from distft.model.families import family_of
from distft.model.files import check_model_path
from distft.model.fp8 import convert_to_float8
from distft.model.lm import causal_lm
from distft.model.nf4 import NF4Spec, quantize_base
from distft.model.positions import scale_rope
from distft.model.presets import DTYPES, PRESETS
from distft.model.start import load_init_adapter
from distft.model.tokens import beside_adapters, fit_vocabulary


def model_config(name: str, trust_remote_code: bool = False, revision: str = "") -> PretrainedConfig:
    """The architecture of `name` without loading weights (preset, local dir, or hub id at
    `revision`)."""
    if name in PRESETS:
        return PRESETS[name].to_config()
    check_model_path(name)
    if Path(name).is_dir():
        if not (Path(name) / "config.json").is_file():
            raise ConfigError(f"Model directory {name} has no config.json.")
        try:
            return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as err:  # config.json cut short, or not a transformers model's
            raise DamagedFileError(
                f"Model directory {name}: its config.json cannot be read ({str(err).strip().splitlines()[0]}). "
                "It is damaged or not a transformers model's: download or export it again."
            ) from None
    try:
        return AutoConfig.from_pretrained(
            name,
            local_files_only=hub_offline(),
            trust_remote_code=trust_remote_code,
            revision=revision or None,
        )
    except OSError as err:
        raise ConfigError(_unreachable_model_message(name, err)) from None


def architecture(cfg: ModelConfig) -> PretrainedConfig:
    """The config `cfg` trains: the model's own, its rotary embeddings stretched as
    `model.rope_scaling` says (`distft.model.positions`)."""
    config = model_config(cfg.name, cfg.trust_remote_code, cfg.revision)
    return scale_rope(config, cfg.rope_scaling, cfg.rope_factor, cfg.name)


def linear_layer_names(model_config: PretrainedConfig, trust_remote_code: bool = False) -> list[str]:
    """The names of the architecture's Linear layers (q_proj, ..., lm_head): what
    `lora.target_modules` may name. The model is built on the meta device: no memory, no weights."""
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(model_config, trust_remote_code=trust_remote_code)
    return sorted({name.rsplit(".", 1)[-1] for name, m in lm.named_modules() if isinstance(m, nn.Linear)})


def check_target_modules(cfg: Config, model_config: PretrainedConfig) -> None:
    """Refuse, before launch, a `lora.target_modules` entry that names no Linear layer of the model
    (peft would skip it silently, or fail in every rank when none matches). A preset (attention,
    mlp, all) is checked as the projections it stands for; all-linear is peft's own, which finds
    the Linear layers of whatever model it is given, so it is never refused."""
    targets = cfg.lora.target_modules
    if cfg.train.method == "full" or targets == ["all-linear"]:  # no adapters, or peft's own search
        return
    names = linear_layer_names(model_config, cfg.model.trust_remote_code)
    wanted = lora_target_names(targets)
    if family_of(model_config, cfg.model.name).moe:
        check_expert_targets(cfg, wanted)
        names += list(EXPERT_PARAMETERS)  # the MLP projections name the experts' stacks
    missing = [t for t in wanted if t not in names]
    if missing:
        named = missing if wanted == targets else [f"{targets[0]} ({', '.join(missing)})"]
        # A misspelt preset is as likely as a misspelt layer: both are offered.
        match = difflib.get_close_matches(
            missing[0], [*names, *LORA_TARGET_PRESETS, "all-linear"], n=1, cutoff=0.5
        )
        hint = f" Did you mean `{match[0]}`?" if match and wanted == targets else ""
        raise ConfigError(
            f"`lora.target_modules` names {', '.join(named)}, which {cfg.model.name} does not have: its "
            f"Linear layers are {', '.join(names)}.{hint}"
        )


# An MoE layer's MLP projections are not Linear layers but the experts' two fused stacks (a
# `Family.moe`): peft's `target_parameters` gives each expert its own adapter on them.
EXPERT_PARAMETERS = {
    "gate_proj": "mlp.experts.gate_up_proj",
    "up_proj": "mlp.experts.gate_up_proj",
    "down_proj": "mlp.experts.down_proj",
}


def check_expert_targets(cfg: Config, wanted: list[str]) -> None:
    """LoRA on an MoE's experts: gate and up together (one fused tensor), and what peft's
    parameter adapters take (no dropout, no DoRA)."""
    experts = [t for t in wanted if t in EXPERT_PARAMETERS]
    if not experts:
        return
    if ("gate_proj" in experts) != ("up_proj" in experts):
        have, lack = ("gate_proj", "up_proj") if "gate_proj" in experts else ("up_proj", "gate_proj")
        raise ConfigError(
            f"`lora.target_modules` names {have} but not {lack}: "
            f"{cfg.model.name}'s experts hold gate and up fused in one tensor (mlp.experts.gate_up_proj), "
            "which takes one adapter. Name both, or neither."
        )
    if cfg.lora.dropout or cfg.lora.variant == "dora":
        setting = "lora.dropout" if cfg.lora.dropout else "lora.variant=dora"
        raise ConfigError(
            f"{setting} cannot apply to {cfg.model.name}'s experts (peft's adapters on parameters take "
            'neither): set lora.dropout=0 and lora.variant=lora or rslora, or lora.target_modules=["attention"].'
        )


def lora_target_parameters(cfg: Config, names: list[str], model_config: PretrainedConfig) -> list[str]:
    """The experts' stacks `names` reaches on an MoE (`EXPERT_PARAMETERS`), for peft's
    `target_parameters`; none on a dense model, or for all-linear (peft's search: Linear layers)."""
    if names == ["all-linear"] or not family_of(model_config, cfg.model.name).moe:
        return []
    return sorted({EXPERT_PARAMETERS[n] for n in lora_target_names(names) if n in EXPERT_PARAMETERS})


def _unreachable_model_message(name: str, err: Exception) -> str:
    offline = hub_offline() or "offline" in str(err).lower() or "connect" in str(err).lower()
    why = (
        "the Hugging Face hub cannot be reached (offline: HF_HUB_OFFLINE is set or there is no network), "
        "and it is not in the local cache"
        if offline
        else f"loading it failed ({str(err).splitlines()[0]})"
    )
    return (
        f"Model {name!r} is not a preset, not a local directory, and {why}. {_nearest_preset(name)}"
        f"Use a preset ({', '.join(PRESETS)}), or download the model where there is network "
        f"(`hf download {name} --local-dir DIR`) and point --model at DIR, the directory holding its "
        "config.json and *.safetensors."
    )


def _nearest_preset(name: str) -> str:
    """ "Did you mean ...?" for a misspelt preset, also written with its family ("qwen3-mirco")."""
    spellings = {key: key for key in PRESETS} | {f"{p.family}-{key}": key for key, p in PRESETS.items()}
    match = difflib.get_close_matches(name.lower(), list(spellings), n=1, cutoff=0.75)
    return f"Did you mean `{spellings[match[0]]}`? " if match and "/" not in name else ""


def load_base_model(
    cfg: ModelConfig, device: torch.device | str | None = None, attention: str | None = None
) -> nn.Module:
    """The causal LM named by `cfg.name`, in `cfg.dtype`, built or loaded straight onto `device`.

    `device=None` means the CPU, for strategies that place or shard the model themselves (FSDP, TP,
    pipelines); single and DDP pass their own device, so a real-size base never exists in fp32 on
    the host. `attention`: the kernel (`distft.model.attention.resolve_attention`; by default what
    `cfg.attn_implementation` resolves to on `device`). A preset is a recipe, (name, seed, dtype, device type): the same recipe gives the same
    weights bit for bit, on every rank and in `distft infer`. On the CPU in float32 the weights are
    the ones a plain `Qwen3ForCausalLM(config)` under `torch.manual_seed(seed)` makes.
    """
    dtype, device = DTYPES[cfg.dtype], torch.device(device or "cpu")
    kernel = transformers_name(attention or resolve_attention(cfg.attn_implementation, device, dtype))
    if cfg.name in PRESETS:
        model = _init_preset(cfg, dtype, device, kernel)
    else:
        kwargs = {
            "dtype": dtype,
            "attn_implementation": kernel,
            "device_map": device,
            "trust_remote_code": cfg.trust_remote_code,
            "use_safetensors": None if cfg.allow_pickle_weights else True,  # None: safetensors, else .bin
        }
        if not Path(cfg.name).is_dir():
            kwargs.update(local_files_only=hub_offline(), revision=cfg.revision or None)
        if cfg.rope_scaling != "none":  # the rotary module reads it when the model is built
            kwargs["config"] = architecture(cfg)
        check_model_path(cfg.name)  # a run's recorded base directory, moved since: not a hub id
        try:
            model = AutoModelForCausalLM.from_pretrained(cfg.name, **kwargs)
        except OSError as err:
            raise ConfigError(_unreachable_model_message(cfg.name, err)) from None
    model.config.use_cache = False  # training never uses the KV cache; it only costs memory
    use_experts(model, cfg.experts_implementation)  # an MoE's expert matmuls; a dense model has none
    return model


def _init_preset(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, kernel: str) -> nn.Module:
    """A preset's random weights, initialised where they will live and in their final dtype."""
    config = scale_rope(PRESETS[cfg.name].to_config(), cfg.rope_scaling, cfg.rope_factor, cfg.name)
    config._attn_implementation = kernel
    # Seeded init so every rank (and every strategy) starts from the same random weights; the
    # generator state of the caller is restored afterwards (CUDA's too, when it is the device).
    forked = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked):
        torch.manual_seed(cfg.seed)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config, dtype=dtype)


RECIPE_FILE = "recipe.json"  # in DIR/base: how to rebuild a preset's random base (`rebuild_base`)


def base_recipe(cfg: ModelConfig, device: torch.device | str | None = None) -> dict:
    """What rebuilds a preset's random base bit for bit: preset, seed, dtype, attention kernel,
    and the device type it was initialised on (CPU and CUDA draw different random streams)."""
    return {
        "preset": cfg.name,
        "seed": cfg.seed,
        "dtype": cfg.dtype,
        "attn_implementation": cfg.attn_implementation,
        "device": torch.device(device or "cpu").type,
        **(
            {"rope_scaling": cfg.rope_scaling, "rope_factor": cfg.rope_factor}
            if cfg.rope_scaling != "none"
            else {}
        ),
    }


def pretrained_origin(cfg: ModelConfig) -> dict:
    """Where a pretrained base came from, for its lineage: the name, the revision asked for, the
    commit it was loaded from (a hub id's, read from the local cache its files were just loaded
    into; None for a directory), and whether its own code was allowed to run."""
    commit = None
    if not Path(cfg.name).is_dir():
        from transformers.utils import cached_file, extract_commit_hash

        try:
            config_file = cached_file(
                cfg.name, "config.json", revision=cfg.revision or None, local_files_only=True
            )
            commit = extract_commit_hash(config_file, None)
        except OSError:
            pass  # not in the cache: nothing to record
    return {
        "model": cfg.name,
        "revision": cfg.revision or None,
        "commit": commit,
        "trust_remote_code": cfg.trust_remote_code,
    }


def rebuild_base(recipe: dict) -> nn.Module:
    """The base a recipe describes (`base_recipe`), on the CPU: equal, bitwise, to the one trained."""
    cfg = ModelConfig(
        name=recipe["preset"],
        seed=recipe["seed"],
        dtype=recipe["dtype"],
        attn_implementation=recipe["attn_implementation"],
        rope_scaling=recipe.get("rope_scaling", "none"),
        rope_factor=recipe.get("rope_factor", 0.0),
    )
    if recipe["device"] == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"This run's base is preset {cfg.name!r} initialised with seed {cfg.seed} on a CUDA device: "
            "CUDA draws a different random stream than the CPU, so the same weights can only be rebuilt "
            "on a machine with a CUDA GPU. Run `distft infer` there, or train on a small preset with "
            "output.save_base=true so the base weights are written to DIR/base."
        )
    return load_base_model(cfg, "cuda" if recipe["device"] == "cuda" else None).to("cpu")


def apply_method(model: nn.Module, cfg: Config, tokenizer=None) -> nn.Module:
    """LoRA: freeze the base and inject adapters (peft). QLoRA: the same on a base whose decoder
    projections are 4-bit NF4 (`distft.model.nf4`). Full: every weight trains. Beside the
    adapters, `lora.modules_to_save` and the rows of `model.added_tokens` train too, the
    embedding grown for those first (`distft.model.tokens`): `tokenizer` is the run's, which
    holds them (`distft.data.tokenizer.with_added_tokens`)."""
    if cfg.model.added_tokens:
        if tokenizer is None:
            raise ValueError("model.added_tokens: apply_method needs the run's tokenizer, which holds them")
        fit_vocabulary(causal_lm(model), tokenizer, cfg.model.seed)
    if cfg.train.method == "full":
        model.requires_grad_(True)
        convert_to_float8(model, cfg.model.fp8)  # model.fp8=all: the decoder's Linear layers
        return model
    if cfg.train.method == "qlora":  # before PEFT wraps the projections
        quantize_base(causal_lm(model).model.layers, NF4Spec.from_config(cfg.model))

    experts = lora_target_parameters(cfg, cfg.lora.target_modules, causal_lm(model).config)
    lora = LoraConfig(
        r=cfg.lora.rank,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=lora_targets(cfg.lora.target_modules, moe=bool(experts)),
        target_parameters=experts or None,
        use_dora=cfg.lora.variant == "dora",
        use_rslora=cfg.lora.variant == "rslora",
        bias="none",
        task_type="CAUSAL_LM",
        **beside_adapters(cfg, causal_lm(model), tokenizer),
    )
    with peft_quietly():
        peft_model = get_peft_model(model, lora)
    read_adapters_directly(peft_model)  # an MoE's experts under grouped_lora: peft's factors as they are
    # peft initialises lora_A from the global RNG: the caller seeds it so every rank agrees.
    if cfg.lora.init_adapter:  # or a trained adapter's weights are the run's at step 0
        load_init_adapter(peft_model, cfg.lora.init_adapter)
    convert_to_float8(peft_model, cfg.model.fp8)  # model.fp8=base: the frozen projections under the adapters
    return peft_model


def lora_targets(names: list[str], moe: bool = False) -> list[str] | str:
    """`lora.target_modules` as peft takes it: a preset (attention, mlp, all) as its module names,
    all-linear as peft's own value (every linear layer but the output head), else the names. On an
    MoE whose experts take adapters (`moe`) the MLP names go to `target_parameters` instead."""
    if names == ["all-linear"]:
        return "all-linear"
    return [n for n in lora_target_names(names) if not (moe and n in EXPERT_PARAMETERS)]


@contextmanager
def peft_quietly() -> Iterator[None]:
    """Around wrapping a model in a PeftModel (`get_peft_model`, `PeftModel.from_pretrained`):
    peft's constructor reads transformers 5's deprecated `is_gradient_checkpointing` alias, a
    FutureWarning on every command that nothing in distft causes (the fix belongs in peft). Only
    that message is silenced, only here; every other warning still shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        yield
