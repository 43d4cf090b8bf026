"""`distft export --format gguf`: a finished run as one GGUF file, what llama.cpp and Ollama load.

Written with the `gguf` package (llama.cpp's gguf-py) as llama.cpp's `convert_hf_to_gguf.py` and
`convert_lora_to_gguf.py` write it: `general.architecture` names llama.cpp's graph (`qwen3`, `qwen2`,
`llama` for Llama 3 and Mistral), the hyperparameters sit under that prefix (`qwen3.block_count`,
`.attention.key_length`: Qwen3's head_dim is not hidden / heads), the tokenizer as
`tokenizer.ggml.model = "gpt2"` (byte-level BPE: tokens in id order padded to one per embedding
row, their types, merges, `tokenizer.ggml.pre` told by a hash of the ids of a fixed text) and
`tokenizer.chat_template` with the run's `enable_thinking` set inside (llama.cpp passes none).
Beside a merged file, Ollama's `Modelfile` (`distft.data.ollama`).

Tensors take llama.cpp's names (gguf's `TensorNameMap`; `output` only when untied). HF rotates
the two halves of each head, llama.cpp's `llama` graph adjacent pairs, so q's and k's rows are
permuted per head (`permute_qk`); Qwen2/3 run llama.cpp's NEOX rope, HF's own. Llama 3.1's rope
scaling becomes a `rope_freqs.weight` of divisors. Vectors stay float32; matrices take `dtype`.
Adapter-only writes the LoRA adapter alone (`adapter.lora.alpha`, `<name>.lora_a` = A, `.lora_b` =
B, rows permuted like W's), which llama.cpp adds as (alpha / r) B A to a GGUF of the base; rsLoRA
is written as alpha sqrt(r), DoRA and fully trained modules are refused. `out`: a `.gguf` file, or
a directory that gets `model.gguf` (`adapter.gguf`). Every check comes first.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import gguf
import torch
from safetensors.torch import load_file
from transformers import PretrainedConfig

from distft.commands.export import GGUF_DTYPES
from distft.data import end_of_turn
from distft.data.ollama import modelfile
from distft.data.template import trained_template
from distft.errors import ConfigError
from distft.export import card_format, check_run, merged_model
from distft.infer import load_trained
from distft.io.files import atomic_write_text, verify_directory
from distft.io.preflight import check_output_path
from distft.model.build import architecture, model_config
from distft.model.families import family_of
from distft.model.positions import rope_parameters

# distft family -> llama.cpp graph (convert_hf_to_gguf.py registers MistralForCausalLM on LlamaModel).
ARCH = gguf.MODEL_ARCH
ARCHS = {"qwen3": ARCH.QWEN3, "qwen2": ARCH.QWEN2, "llama": ARCH.LLAMA, "mistral": ARCH.LLAMA}
FT = gguf.LlamaFileType
FILE_TYPES = dict(zip(GGUF_DTYPES, (FT.ALL_F32, FT.MOSTLY_F16, FT.MOSTLY_BF16, FT.MOSTLY_Q8_0), strict=True))
Q8_0 = gguf.GGMLQuantizationType.Q8_0
# llama.cpp names a BPE pre-tokenizer by sha256(str(tokenizer.encode(CHECK_TEXT))) (get_vocab_base_pre).
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) "
    "✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
    "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
PRE_TOKENIZERS = {
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5 .. Qwen3
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen3-Embedding
    "0f7f7a35e66abf8b3152dfa269f54f94bd9de44a6258727d2c14e76f6d5925b0": "qwen2",  # its first 4,064 ranks (micro)
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Llama 3
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",  # Mistral Nemo
}
ROPE_TYPES = ("default", "linear", "yarn", "llama3")  # what llama.cpp's graphs compute
Named = tuple[str, torch.Tensor]  # a tensor under its GGUF name
name_map = functools.cache(gguf.get_tensor_name_map)  # (arch, blocks) -> HF to GGUF names


# ---- checks, before anything is loaded -----------------------------------------------------


def check_gguf_out(out: Path, adapter_only: bool) -> Path:
    """The file written: `out` when it ends in .gguf, else `out/model.gguf` (`adapter.gguf`); it
    replaces nothing a run wrote and can be written."""
    if out.suffix != ".gguf" and out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file not ending in .gguf; give a .gguf file or a directory.")
    path = out if out.suffix == ".gguf" else out / ("adapter.gguf" if adapter_only else "model.gguf")
    check_output_path(path, "--out")
    return path


def run_architecture(run_dir: Path, cfg) -> PretrainedConfig:
    """The trained architecture, from config files only; refused when llama.cpp cannot run it."""
    saved = run_dir / ("model" if cfg.train.method == "full" else "base")  # else a preset's recipe
    config = model_config(str(saved)) if (saved / "config.json").is_file() else architecture(cfg.model)
    family_of(config, cfg.model.name)
    rope = rope_parameters(config).get("rope_type", "default")
    graph = ARCHS.get(config.model_type)  # None: a mixture of experts, whose tensors are not written yet
    if graph is None or rope not in ROPE_TYPES or (rope == "llama3" and graph != ARCH.LLAMA):
        why = f"uses {rope!r} rope scaling, which llama.cpp's {config.model_type} graph does not compute"
        raise ConfigError(
            f"--format gguf: the run's model {why if graph else 'is a mixture of experts, not yet written as GGUF'}; "
            "export it as safetensors (leave out --format gguf) instead."
        )
    return config


def check_adapter(run_dir: Path, cfg) -> dict:
    """adapter_config.json, once its adapter is known to fit llama.cpp's LoRA format."""
    if cfg.train.method == "full":
        raise ConfigError(
            f"--adapter-only: the run {run_dir} is a full finetune, which has no adapter to export; "
            "leave out --adapter-only to write the whole model as one GGUF file."
        )
    verify_directory(run_dir / "adapter", "The adapter", "Restore it from a copy, or train the run again.")
    settings = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    found = [
        why
        for why, present in (
            ("a DoRA magnitude per output feature", settings.get("use_dora")),
            ("modules trained whole (lora.modules_to_save)", settings.get("modules_to_save")),
            ("a rank or alpha per module", settings.get("rank_pattern") or settings.get("alpha_pattern")),
        )
        if present
    ]
    if found:
        raise ConfigError(
            f"--adapter-only: the adapter of {run_dir} has {found[0]}, which a llama.cpp LoRA adapter (B and "
            "A under one alpha) cannot hold; leave out --adapter-only to merge it into the model instead."
        )
    return settings


# ---- tensors as llama.cpp names and lays them out ------------------------------------------


def permute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's `LlamaModel.permute`: within each head, rows [x0..x(d/2-1), y0..] (HF's halves)
    become [x0, y0, x1, y1, ...] (the adjacent pairs llama's rope rotates). weight: (n_head * d, ...)."""
    heads = weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
    return heads.swapaxes(1, 2).reshape(weight.shape)


def qk_heads(hf_name: str, config: PretrainedConfig) -> int | None:
    """The heads to permute `hf_name` over for the `llama` graph (q: all, k: the KV heads), or None."""
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    return heads.get(hf_name.split(".")[-2]) if ARCHS[config.model_type] == ARCH.LLAMA else None


def gguf_name(hf_name: str, config: PretrainedConfig) -> str:
    """`model.layers.3.mlp.up_proj.weight` -> `blk.3.ffn_up.weight` (gguf's TensorNameMap)."""
    names = name_map(ARCHS[config.model_type], config.num_hidden_layers)
    name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ConfigError(f"--format gguf: {hf_name} has no llama.cpp name in {config.model_type}.")
    return name


def rope_freqs(config: PretrainedConfig) -> torch.Tensor | None:
    """Llama 3.1's rope scaling as llama.cpp reads it (the converter's formula): a divisor per rotary
    frequency, 1 for the high ones, `factor` for the low ones, smoothed between."""
    params = rope_parameters(config)
    if params.get("rope_type") != "llama3":
        return None
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return torch.where(wavelen < old / high, 1.0, torch.where(wavelen > old / low, factor, medium))


def model_tensors(state: dict[str, torch.Tensor], config: PretrainedConfig) -> Iterator[Named]:
    """The merged model's tensors under llama.cpp's names, q/k permuted for `llama`, no tied head."""
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp reads the head from token_embd when `output` is absent
        if (heads := qk_heads(hf_name, config)) is not None:
            tensor = permute_qk(tensor, heads)
        yield gguf_name(hf_name, config), tensor
    if (freqs := rope_freqs(config)) is not None:
        yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", freqs


def adapter_tensors(state: dict[str, torch.Tensor], config: PretrainedConfig) -> Iterator[Named]:
    """PEFT's `base_model.model.<W>.lora_A.weight` / `lora_B` as `<gguf W>.lora_a` / `.lora_b`.
    Permuting W's rows permutes B's rows only: P (B A) = (P B) A."""
    for key in sorted(state):
        if not key.endswith((".lora_A.weight", ".lora_B.weight")):
            raise ConfigError(f"--adapter-only: {key} is not a LoRA matrix; merge the run instead.")
        hf_name = key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] + ".weight"
        name, tensor = gguf_name(hf_name, config), state[key]
        if key.endswith(".lora_B.weight") and (heads := qk_heads(hf_name, config)) is not None:
            tensor = permute_qk(tensor, heads)
        yield name + (".lora_a" if ".lora_A." in key else ".lora_b"), tensor


def add_tensors(writer: gguf.GGUFWriter, tensors: Iterable[Named], dtype: str) -> None:
    """Vectors in float32 (as the converter keeps norms and biases); matrices in `dtype`, each
    rounded once from what the merge computed (bfloat16 as raw bits, gguf's BF16 type)."""
    for name, tensor in tensors:
        tensor = tensor.detach().contiguous()
        if tensor.ndim < 2 or dtype == "float32":
            writer.add_tensor(name, tensor.float().numpy())
        elif dtype == "bfloat16":
            bits = tensor.to(torch.bfloat16).view(torch.int16).numpy()
            writer.add_tensor(name, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
        elif dtype == "q8_0" and tensor.shape[-1] % gguf.GGML_QUANT_SIZES[Q8_0][0] == 0:
            writer.add_tensor(name, gguf.quants.quantize(tensor.float().numpy(), Q8_0), raw_dtype=Q8_0)
        else:  # float16; q8_0's rows that are no whole number of blocks, as the converter falls back
            writer.add_tensor(name, tensor.to(torch.float16).numpy())


# ---- metadata ------------------------------------------------------------------------------


def add_hparams(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    """The hyperparameters llama.cpp's graph reads, under `<arch>.` (convert_hf_to_gguf's TextModel)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = rope_parameters(config)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    if rope.get("rope_type") in ("linear", "yarn"):  # llama3: the rope_freqs tensor instead
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(float(rope["factor"]))
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))


def token_table(tokenizer, n_vocab: int) -> tuple[list[str], list[int]]:
    """One token per embedding row, with its llama.cpp type (convert_hf_to_gguf's get_vocab_base)."""
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    if max(by_id) >= n_vocab:
        raise ConfigError(f"--format gguf: the tokenizer's ids reach {max(by_id)}, past {n_vocab} rows.")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(n_vocab)]
    kind = gguf.TokenType
    types = [
        kind.UNUSED if i not in by_id
        else kind.NORMAL if i not in added
        else kind.CONTROL if added[i].special or (token.startswith("<|") and token.endswith("|>"))
        else kind.USER_DEFINED
        for i, token in enumerate(tokens)
    ]  # fmt: skip
    return tokens, types


def add_tokenizer(writer: gguf.GGUFWriter, tokenizer, config: PretrainedConfig, thinking: bool) -> None:
    """`tokenizer.ggml.*` and the chat template: byte-level BPE as llama.cpp's `gpt2` vocabulary."""
    bpe = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    digest = hashlib.sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest()
    if bpe["type"] != "BPE" or bpe.get("byte_fallback") or digest not in PRE_TOKENIZERS:
        raise ConfigError(
            f"--format gguf: the run's tokenizer is no byte-level BPE that distft knows llama.cpp's name for "
            f"(Qwen2/3, Llama 3, Mistral Nemo; its hash {digest[:12]}); export safetensors and convert those."
        )
    tokens, types = token_table(tokenizer, config.vocab_size)
    merges = bpe["merges"]  # pairs since tokenizers 0.20; gguf keeps "a b", a space as U+0120
    if merges and not isinstance(merges[0], str):
        merges = [" ".join(part.replace(" ", "\u0120") for part in pair) for pair in merges]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZERS[digest])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    ids = tokenizer.encode("a")  # what the tokenizer adds around a text, llama.cpp adds too
    for kind, around in (("bos", ids[:1]), ("eos", ids[-1:]), ("pad", None)):
        value = getattr(tokenizer, f"{kind}_token_id")  # then the config's, as gguf's SpecialVocab
        value = getattr(config, f"{kind}_token_id", None) if value is None else value
        value = value[0] if isinstance(value, list) else value  # a config may list several eos ids
        if value is not None:
            getattr(writer, f"add_{kind}_token_id")(value)
            if around is not None:
                getattr(writer, f"add_add_{kind}_token")(around == [value])
    if tokenizer.chat_template:
        writer.add_chat_template(trained_template(tokenizer, thinking))
        with contextlib.suppress(ConfigError):  # a template with no end-of-turn token: eos ends it
            writer.add_eot_token_id(end_of_turn(tokenizer).id)


# ---- the command -----------------------------------------------------------------------------


def write_adapter(writer: gguf.GGUFWriter, run_dir: Path, settings: dict, config, dtype: str) -> None:
    """The adapter's A and B as llama.cpp's LoRA tensors, under the alpha that gives PEFT's scale."""
    scale = math.sqrt(settings["r"]) if settings.get("use_rslora") else 1.0  # rsLoRA: alpha / sqrt(r)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(settings["lora_alpha"]) * scale)
    state = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    add_tensors(writer, adapter_tensors(state, config), dtype)


def write_merged(writer: gguf.GGUFWriter, run_dir: Path, dtype: str, name: str) -> str:
    """The run loaded and merged by `distft export`'s helpers (bfloat16 merged as `distft export
    --dtype bfloat16` merges, the others in float32); returns the Modelfile for the file `name`."""
    loaded = load_trained(run=str(run_dir))
    merge = "bfloat16" if dtype == "bfloat16" else "float32"
    with torch.no_grad():
        model = merged_model(loaded.model, loaded.has_adapter, merge)
    writer.add_type(gguf.GGUFType.MODEL)
    add_hparams(writer, model.config)
    add_tokenizer(writer, loaded.tokenizer, model.config, loaded.cfg.data.enable_thinking)
    add_tensors(writer, model_tensors(model.state_dict(), model.config), dtype)
    system = loaded.cfg.data.system_prompt if card_format(loaded.cfg) == "summary" else ""
    return modelfile(name, loaded.tokenizer, loaded.cfg.data.enable_thinking, system)


def export_gguf(
    run_dir: str | Path, out: str | Path, dtype: str = "bfloat16", adapter_only: bool = False
) -> Path:
    """Write the run in `run_dir` as a GGUF model (merged) or LoRA adapter; returns the file written."""
    run_dir, out = Path(run_dir), Path(out)
    if dtype not in GGUF_DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: a GGUF export takes {', '.join(GGUF_DTYPES)}.")
    cfg = check_run(run_dir)
    path = check_gguf_out(out, adapter_only)
    settings = check_adapter(run_dir, cfg) if adapter_only else None
    config = run_architecture(run_dir, cfg)
    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[ARCHS[config.model_type]])
    writer.add_name(run_dir.resolve().name)
    writer.add_file_type(FILE_TYPES[dtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    text = (  # the Modelfile, beside a merged file
        write_merged(writer, run_dir, dtype, path.name)
        if settings is None
        else write_adapter(writer, run_dir, settings, config, dtype)
    )
    partial = path.with_name(path.name + ".partial")  # renamed when whole: `path` is never half a file
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        writer.write_header_to_file(path=partial)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    if text:
        atomic_write_text(path.parent / "Modelfile", text)
    return path
