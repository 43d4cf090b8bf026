"""`distft export --format gguf`: a run as the GGUF file llama.cpp and Ollama load.

One one-step LoRA run per family, trained once in this process: `micro` (qwen3: tied embeddings,
q/k norms) and `llama-micro` (untied, Llama 3.1's rope scaling, q/k permuted for llama.cpp's
rope). The Qwen3 run is exported merged and read back with gguf's own reader; the Llama run's
tensors and rope factors go through the same functions without a tokenizer (the slow part: 450k
strings to write and to parse). Both adapters are exported alone. The file's chat template, and
the Modelfile's Go template beside it, render the prompt distft trained on, token for token. With
llama-cpp-python installed, llama.cpp itself runs the merged Qwen3 file, and the Llama base with
its adapter, against transformers.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path
from unittest import mock

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from distft.config import load_config
from distft.data import ChatFormatter, Message
from distft.data.ollama import modelfile, ollama_template
from distft.data.template import render, trained_template
from distft.data.tokenizer import load_tokenizer, qwen3_tokenizer
from distft.errors import ConfigError
from distft.export import merged_model
from distft.export_gguf import ARCHS, add_hparams, add_tensors, export_gguf, model_tensors, permute_qk
from distft.model import PRESETS
from distft.train import train

TRAIN = [
    "train.max_steps=1",
    "train.global_batch_size=2",
    "train.micro_batch_size=2",
    "train.eval_batches=0",
    "data.max_length=256",
    "data.max_rows=4",
    "optim.lr=1e-2",
    "optim.warmup_steps=0",
]
MEETING = "Anna: the budget is 1,250 euros.\nBen: agreed, ship it on Friday."
TEXT = "Anna: the budget is 1,250 euros.<|im_end|>\nBen: agreed — ship it on Friday, with the new logo."


def trained(tmp_path_factory, preset: str):
    """(the run directory, its trained PeftModel, that model merged into plain float32 weights)."""
    run = tmp_path_factory.mktemp(preset) / "run"
    cfg = load_config(None, [*TRAIN, f"model.name={preset}", "train.method=lora", f"output.dir={run}"])
    peft_model = train(cfg).model.lm.eval()
    with torch.no_grad():
        merged = merged_model(copy.deepcopy(peft_model), True, "float32")
    return run, peft_model, merged


def read(path) -> gguf.GGUFReader:
    """gguf's reader over the file in memory: on its memmap, numpy's per-slice overhead makes the
    ~450k tokenizer strings of a Qwen3 vocabulary take ~25 s to parse; on a plain array ~5 s."""
    with mock.patch.object(np, "memmap", lambda path, mode="r": np.fromfile(path, dtype=np.uint8)):
        return gguf.GGUFReader(path)


def field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def tensors(reader: gguf.GGUFReader) -> dict[str, torch.Tensor]:
    """name -> float32 tensor in torch's (out, in) order, whatever type the file stores."""
    return {
        t.name: torch.from_numpy(gguf.quants.dequantize(np.array(t.data), t.tensor_type).astype(np.float32))
        for t in reader.tensors
    }


def shapes(reader: gguf.GGUFReader) -> dict[str, tuple[int, ...]]:
    """name -> shape in torch's order (ggml lists the innermost dimension first)."""
    return {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """`permute_qk` undone, written independently: llama.cpp's pair order back to HF's halves."""
    pairs = weight.reshape(n_head, weight.shape[0] // n_head // 2, 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def expected_names(config) -> set[str]:
    per_block = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    per_block += ["attn_norm", "ffn_norm"]
    per_block += ["attn_q_norm", "attn_k_norm"] if config.model_type == "qwen3" else []
    names = {f"blk.{i}.{n}.weight" for i in range(config.num_hidden_layers) for n in per_block}
    if config.model_type == "qwen2":  # q/k/v biases
        names |= {f"blk.{i}.attn_{n}.bias" for i in range(config.num_hidden_layers) for n in "qkv"}
    names |= {"token_embd.weight", "output_norm.weight"}
    return names if config.tie_word_embeddings else names | {"output.weight"}


def write(path: Path, config, state: dict[str, torch.Tensor], dtype: str) -> gguf.GGUFReader:
    """A GGUF of hyperparameters and tensors only (no tokenizer), read back."""
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[ARCHS[config.model_type]])
    add_hparams(writer, config)
    add_tensors(writer, model_tensors(state, config), dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(path)


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """The micro run, its models, tokenizer, and merged GGUF (written into a directory) read back."""
    run, _, merged = trained(tmp_path_factory, "micro")
    path = export_gguf(run, run.parent / "gguf", "float32", adapter_only=False)
    assert path == run.parent / "gguf" / "model.gguf"
    return run, merged, load_tokenizer(str(run / "base")), path, read(path)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return trained(tmp_path_factory, "llama-micro")


# ---- the merged model ------------------------------------------------------------------------


def test_qwen3_metadata(qwen3):
    _, merged, _, _, reader = qwen3
    config = merged.config
    assert field(reader, "general.architecture") == "qwen3"
    assert field(reader, "general.type") == "model"
    assert field(reader, "general.file_type") == gguf.LlamaFileType.ALL_F32
    expected = {
        "block_count": config.num_hidden_layers,
        "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size,
        "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "attention.key_length": config.head_dim,
        "rope.freq_base": config.rope_parameters["rope_theta"],
    }
    assert {k: field(reader, f"qwen3.{k}") for k in expected} == expected
    assert field(reader, "qwen3.attention.layer_norm_rms_epsilon") == pytest.approx(config.rms_norm_eps)


def test_qwen3_tokenizer(qwen3):
    """One token per embedding row: the tokenizer's 151,669 tokens at their ids, then padding;
    its merges, special ids, and chat template."""
    _, merged, tokenizer, _, reader = qwen3
    tokens, types = field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == merged.config.vocab_size == merged.model.embed_tokens.weight.shape[0]
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    assert len(by_id) == len(tokenizer) and all(tokens[i] == t for i, t in by_id.items())
    assert tokens[len(tokenizer)] == f"[PAD{len(tokenizer)}]" and types[-1] == gguf.TokenType.UNUSED
    im_end, think = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<think>"])
    assert types[im_end] == gguf.TokenType.CONTROL and types[think] == gguf.TokenType.USER_DEFINED
    assert types[tokenizer.encode("hello")[0]] == gguf.TokenType.NORMAL
    assert field(reader, "tokenizer.ggml.model") == "gpt2" and field(reader, "tokenizer.ggml.pre") == "qwen2"
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    assert len(reader.fields["tokenizer.ggml.merges"].data) == len(merges)
    assert field(reader, "tokenizer.ggml.merges")[:3] == [" ".join(pair) for pair in merges[:3]]
    assert (
        field(reader, "tokenizer.ggml.eos_token_id") == im_end == field(reader, "tokenizer.ggml.eot_token_id")
    )
    assert field(reader, "tokenizer.ggml.padding_token_id") == tokenizer.pad_token_id
    assert field(reader, "tokenizer.ggml.bos_token_id") == merged.config.bos_token_id
    assert field(reader, "tokenizer.ggml.add_bos_token") is False  # Qwen adds no bos
    assert field(reader, "tokenizer.chat_template").endswith(tokenizer.chat_template)  # enable_thinking set


def test_qwen3_tensors_are_the_merged_weights(qwen3):
    """Every weight of the transformers model merged in float32, bit for bit, under llama.cpp's
    names; the tied head is left out. The LoRA moved them (the merge is not a no-op)."""
    run, merged, _, _, reader = qwen3
    found, state = tensors(reader), merged.state_dict()
    assert set(found) == expected_names(merged.config)
    assert shapes(reader) == {name: tuple(t.shape) for name, t in found.items()}
    assert shapes(reader)["blk.0.attn_k.weight"] == (16, 32)  # 2 KV heads of 8, from 32 features
    assert torch.equal(found["token_embd.weight"], state["model.embed_tokens.weight"])
    assert torch.equal(found["blk.2.attn_q.weight"], state["model.layers.2.self_attn.q_proj.weight"])
    assert torch.equal(found["blk.3.attn_k_norm.weight"], state["model.layers.3.self_attn.k_norm.weight"])
    assert torch.equal(found["blk.1.ffn_down.weight"], state["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(found["output_norm.weight"], state["model.norm.weight"])
    base = load_file(run / "base" / "model.safetensors")["model.layers.2.self_attn.q_proj.weight"]
    assert not torch.equal(found["blk.2.attn_q.weight"], base)


def test_llama_tensors_are_permuted_for_llama_cpp_rope(llama, tmp_path):
    """The tensor half of a Llama export: q and k come out permuted per head (undone, they are the
    merged weights), the untied head is written, and Llama 3.1's rope factors are what
    transformers divides the rotary frequencies by."""
    _, _, merged = llama
    config, state = merged.config, merged.state_dict()
    reader = write(tmp_path / "llama.gguf", config, state, "float32")
    found = tensors(reader)
    assert field(reader, "general.architecture") == "llama" and field(reader, "llama.block_count") == 4
    assert set(found) == expected_names(config) | {"rope_freqs.weight"}
    q, k = found["blk.1.attn_q.weight"], found["blk.1.attn_k.weight"]
    assert torch.equal(unpermute_qk(q, 4), state["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(unpermute_qk(k, 2), state["model.layers.1.self_attn.k_proj.weight"])
    assert not torch.equal(q, state["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(found["output.weight"], state["lm_head.weight"])
    assert torch.equal(found["blk.1.attn_v.weight"], state["model.layers.1.self_attn.v_proj.weight"])
    plain = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, 8, 2).float() / 8))
    scaled = merged.model.rotary_emb.inv_freq  # transformers' llama3 scaling of `plain`
    torch.testing.assert_close(plain / found["rope_freqs.weight"], scaled, rtol=1e-6, atol=0)
    assert not torch.equal(found["rope_freqs.weight"], torch.ones(4))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_rounds_each_matrix_once(llama, tmp_path, dtype):
    _, _, merged = llama
    state = merged.state_dict()
    reader = write(tmp_path / "half.gguf", merged.config, state, dtype)
    kinds, found = {t.name: t.tensor_type for t in reader.tensors}, tensors(reader)
    assert kinds["blk.0.ffn_up.weight"].name == {"float16": "F16", "bfloat16": "BF16"}[dtype]
    assert kinds["blk.0.attn_norm.weight"] == kinds["rope_freqs.weight"] == gguf.GGMLQuantizationType.F32
    up = state["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(found["blk.0.ffn_up.weight"], up.to(getattr(torch, dtype)).float())


def test_q8_0_quantizes_each_matrix_within_half_a_step(llama, tmp_path):
    """q8_0 as llama.cpp's converter writes it (gguf's quantizer): each matrix in blocks of 32 int8
    values under one float16 scale, the block's largest magnitude / 127; read back and dequantized,
    each value is within half a step of the merged weight (plus the scale's float16 rounding)."""
    _, _, merged = llama
    state = merged.state_dict()
    reader = write(tmp_path / "q8.gguf", merged.config, state, "q8_0")
    kinds, found = {t.name: t.tensor_type for t in reader.tensors}, tensors(reader)
    kind = gguf.GGMLQuantizationType
    assert kinds["blk.0.ffn_down.weight"] == kinds["token_embd.weight"] == kinds["output.weight"] == kind.Q8_0
    assert kinds["blk.0.attn_norm.weight"] == kinds["rope_freqs.weight"] == kind.F32
    for name, hf_name in [("blk.0.ffn_down.weight", "mlp.down_proj"), ("token_embd.weight", "embed_tokens")]:
        blocks = (
            state[f"model.{'layers.0.' * name.startswith('blk')}{hf_name}.weight"].float().reshape(-1, 32)
        )
        step = blocks.abs().amax(1, keepdim=True) / 127
        error = (found[name].reshape(-1, 32) - blocks).abs()
        assert (error <= 0.57 * step).all() and error.max() > 0


@pytest.mark.parametrize(("preset", "arch"), [("qwen2-micro", "qwen2"), ("mistral-micro", "llama")])
def test_the_other_families_map_to_llama_cpp_names(preset, arch, tmp_path):
    """Qwen2.5 (q/k/v biases, unpermuted) and Mistral (llama.cpp's llama graph: q/k permuted) on
    their randomly initialised micro presets."""
    model = AutoModelForCausalLM.from_config(PRESETS[preset].to_config())
    state = model.state_dict()
    reader = write(tmp_path / "model.gguf", model.config, state, "float32")
    found = tensors(reader)
    assert field(reader, "general.architecture") == arch
    assert set(found) == expected_names(model.config)
    q, q_bias = found["blk.3.attn_q.weight"], found.get("blk.3.attn_q.bias")
    if arch == "llama":
        q = unpermute_qk(q, 4)
    else:
        assert torch.equal(q_bias, state["model.layers.3.self_attn.q_proj.bias"])
    assert torch.equal(q, state["model.layers.3.self_attn.q_proj.weight"])


def test_permute_qk_pairs_the_halves_of_each_head():
    rows = torch.arange(16).float().unsqueeze(1)  # 2 heads of 8 rows
    assert permute_qk(rows, 2).squeeze(1).tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]


# ---- the prompt as trained -------------------------------------------------------------------------


def meeting(cfg) -> list[Message]:
    """A meeting's prompt as the run asks: its system prompt, then its instruction and the transcript."""
    return [Message("system", (cfg.data.system_prompt,)), Message("user", (cfg.data.instruction, MEETING))]


def chats(cfg) -> list[list[Message]]:
    """Chats of one text per message, with the run's system prompt and without."""
    turns = ["Who pays?", "Anna does.", "When?"]
    chat = [Message("user" if i % 2 == 0 else "assistant", (t,)) for i, t in enumerate(turns)]
    return [[meeting(cfg)[0], *chat], chat]


def as_dicts(messages: list[Message]) -> list[dict]:
    return [{"role": m.role, "content": "\n\n".join(m.parts)} for m in messages]


def check_trained_prompt(render_served, tokenizer, cfg) -> None:
    """`render_served(messages)` is the prompt distft trained on, token for token (a meeting's tokens:
    the test below)."""
    formatter = ChatFormatter(tokenizer, cfg.data)
    for messages in chats(cfg):
        text = render_served(as_dicts(messages))
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # data.enable_thinking=false
        assert tokenizer.encode(text, add_special_tokens=False) == formatter.generation_ids(messages)
    assert render_served(as_dicts(meeting(cfg))) == tokenizer.decode(formatter.prompt_ids(MEETING))


def served_template(tokenizer, reader):
    """The file's chat template as llama.cpp and transformers render it: jinja2, no enable_thinking."""
    served = copy.copy(tokenizer)
    served.chat_template = field(reader, "tokenizer.chat_template")
    return lambda chat: served.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_the_files_chat_template_renders_the_trained_prompt(qwen3):
    """The run trained with data.enable_thinking=false: its prompts end in Qwen3's empty think
    block, which the template renders only when told; the file's template needs no telling."""
    run, _, tokenizer, _, reader = qwen3
    check_trained_prompt(
        served_template(tokenizer, reader), tokenizer, load_config(run / "config.toml", run=True)
    )


def test_a_meetings_prompt_tokens_are_the_served_prompts(qwen3):
    """The instruction ends in "." and the transcript follows a blank line: a server tokenising the
    whole prompt merges ".\\n\\n" into one token (Qwen3's 382), and so does training."""
    run, _, tokenizer, _, reader = qwen3
    cfg = load_config(run / "config.toml", run=True)
    text = served_template(tokenizer, reader)(as_dicts(meeting(cfg)))
    assert tokenizer.encode(text, add_special_tokens=False) == ChatFormatter(tokenizer, cfg.data).prompt_ids(
        MEETING
    )


@pytest.mark.parametrize("thinking", [False, True])
def test_trained_template_sets_the_runs_thinking_mode(thinking):
    tokenizer = qwen3_tokenizer()
    served = copy.copy(tokenizer)
    served.chat_template = trained_template(tokenizer, thinking)
    chat = [{"role": "user", "content": "hi"}]
    for passed in ({}, {"enable_thinking": not thinking}):  # what a caller passes does not matter
        text = served.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **passed)
        assert text == render(tokenizer, chat, True, thinking)
    chatml = copy.copy(tokenizer)  # a template with no thinking mode is written as it is
    chatml.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    assert trained_template(chatml, False) == chatml.chat_template


GO_ACTION = re.compile(r"{{(-?)\s*(.*?)\s*(-?)}}", re.S)


def go_parse(pieces: list, at: int = 0) -> tuple[list, int, str | None]:
    """Go text/template's nodes from `pieces` (text, then an action, alternately) up to an `end`,
    `else` or `else if` (returned, with where it stopped)."""
    nodes = []
    while at < len(pieces):
        piece, action, at = pieces[at], at % 2 == 1, at + 1
        if not action:
            nodes.append(piece)
        elif piece == "end" or piece.startswith("else"):
            return nodes, at, piece
        elif piece.startswith(("if ", "range ")):
            kind, branches, stop = piece.split(" ", 1)[0], [], piece
            while stop != "end":
                body, at, next_stop = go_parse(pieces, at)
                branches.append(
                    (stop.removeprefix("else").strip().removeprefix("if ").removeprefix("range "), body)
                )
                stop = next_stop
            nodes.append((kind, branches))
        else:
            nodes.append(("value", piece))
    return nodes, at, None


def go_value(expression: str, dot):
    if expression.startswith("eq "):
        left, right = expression[3:].split(" ", 1)
        return go_value(left, dot) == json.loads(right)
    return dot[expression.removeprefix(".")]


def go_execute(nodes: list, dot) -> str:
    out = ""
    for node in nodes:
        if isinstance(node, str):
            out += node
        elif node[0] == "value":
            out += go_value(node[1], dot)
        elif node[0] == "range":
            out += "".join(go_execute(node[1][0][1], item) for item in go_value(node[1][0][0], dot))
        else:  # the first branch whose condition holds (an `else` has none)
            out += next(
                (go_execute(body, dot) for cond, body in node[1] if not cond or go_value(cond, dot)), ""
            )
    return out


def go_render(template: str, messages: list[dict]) -> str:
    """A Go text/template renderer for what a chat template uses (fields, if / else if / else, range,
    eq, {{- -}} trimming), given what Ollama gives it: .System the system messages joined, .Messages
    every message."""
    pieces, at, trim = [], 0, False
    for match in GO_ACTION.finditer(template):
        text = template[at : match.start()]
        text = text.lstrip() if trim else text
        pieces += [text.rstrip() if match[1] else text, match[2]]
        at, trim = match.end(), bool(match[3])
    pieces.append(template[at:].lstrip() if trim else template[at:])
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    dot = {"System": system, "Messages": [{"Role": m["role"], "Content": m["content"]} for m in messages]}
    return go_execute(go_parse(pieces)[0], dot)


def test_go_render_reads_go_templates():
    template = (
        "{{- if .System }}S:{{ .System }} {{ end }}{{ range .Messages }}"
        '{{ if eq .Role "user" }}U:{{ .Content }}{{ else if eq .Role "assistant" }}A:{{ .Content }}'
        "{{ else }}?{{ end }}{{ end }}\n  {{- if .System }}.{{ end }}"
    )
    roles = ["system", "user", "assistant"]
    assert go_render(template, [{"role": r, "content": r[0]} for r in roles]) == "S:s ?U:uA:a."
    assert go_render(template, [{"role": "user", "content": "u"}]) == "U:u"


def read_modelfile(path: Path) -> dict[str, list[str]]:
    """A Modelfile's commands: name -> values, a \"\"\"-quoted value as written, # comments skipped."""
    commands: dict[str, list[str]] = {}
    for name, value in re.findall(r'^(\w+) ("""[\s\S]*?"""|.*)$', path.read_text(), re.M):
        commands.setdefault(name, []).append(value.removeprefix('"""').removesuffix('"""'))
    return commands


def test_the_modelfile_renders_the_trained_prompt(qwen3):
    """Ollama's Modelfile beside the file: its Go template, rendered as Ollama renders it, is the
    prompt distft trained on; the run's system prompt and end-of-turn token are its SYSTEM and stop."""
    run, _, tokenizer, path, _ = qwen3
    cfg = load_config(run / "config.toml", run=True)
    commands = read_modelfile(path.parent / "Modelfile")
    assert commands["FROM"] == ["./model.gguf"] and commands["SYSTEM"] == [cfg.data.system_prompt]
    assert commands["PARAMETER"] == ["stop <|im_end|>"]
    (template,) = commands["TEMPLATE"]
    check_trained_prompt(lambda chat: go_render(template, chat), tokenizer, cfg)


def test_ollama_template_of_other_chat_templates():
    """A default system prompt the template writes for a chat without one is kept; a template that
    folds the system prompt into the user turn has no Go template of this shape (the Modelfile says so)."""
    chatml = copy.copy(qwen3_tokenizer())
    chatml.chat_template = (
        "{% if messages[0].role != 'system' %}<|im_start|>system\nYou are Qwen.<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    for chat in [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}],
    ]:
        assert go_render(ollama_template(chatml, False), chat) == render(chatml, chat, True, False)
    folded = copy.copy(chatml)
    folded.chat_template = (
        "{% for m in messages %}{% if m.role == 'user' %}[INST] "
        "{% if loop.last and messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
        "{{ m.content }} [/INST]{% elif m.role == 'assistant' %}"
        "{{ m.content }}<|im_end|>{% endif %}{% endfor %}"
    )
    assert ollama_template(folded, False) is None
    assert "\n# no TEMPLATE" in modelfile("model.gguf", folded, False, "")


# ---- the adapter alone ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "dtype"), [("qwen3", "float32"), ("llama", "float32"), ("llama", "bfloat16")]
)
def test_adapter_only_holds_the_adapter(family, dtype, qwen3, llama, tmp_path):
    """lora_a is A and lora_b is B as PEFT saved them (B's rows permuted for llama's q/k), under
    the run's alpha; llama.cpp scales by alpha / r with r read from the shapes."""
    run, config = (qwen3[0], qwen3[1].config) if family == "qwen3" else (llama[0], llama[2].config)
    path = export_gguf(run, tmp_path, dtype, adapter_only=True)
    assert path == tmp_path / "adapter.gguf"
    reader, saved = gguf.GGUFReader(path), load_file(run / "adapter" / "adapter_model.safetensors")
    assert field(reader, "general.architecture") == family
    assert field(reader, "general.type") == "adapter" and field(reader, "adapter.type") == "lora"
    assert field(reader, "adapter.lora.alpha") == 32.0
    found = {name: t.to(saved[next(iter(saved))].dtype) for name, t in tensors(reader).items()}
    rounded = {k: v.to(getattr(torch, dtype)).float() for k, v in saved.items()}
    assert len(found) == len(saved) == 2 * 7 * config.num_hidden_layers
    prefix = "base_model.model.model.layers.2."
    assert shapes(reader)["blk.2.ffn_gate.weight.lora_a"] == (16, 32)  # A: (r, in)
    assert shapes(reader)["blk.2.ffn_gate.weight.lora_b"] == (96, 16)  # B: (out, r)
    assert torch.equal(found["blk.2.ffn_gate.weight.lora_a"], rounded[prefix + "mlp.gate_proj.lora_A.weight"])
    assert torch.equal(found["blk.2.ffn_gate.weight.lora_b"], rounded[prefix + "mlp.gate_proj.lora_B.weight"])
    assert torch.equal(
        found["blk.2.attn_q.weight.lora_a"], rounded[prefix + "self_attn.q_proj.lora_A.weight"]
    )
    b = found["blk.2.attn_q.weight.lora_b"]
    unpermuted = b if family == "qwen3" else unpermute_qk(b, 4)
    assert torch.equal(unpermuted, rounded[prefix + "self_attn.q_proj.lora_B.weight"])


# ---- refusals, before anything is loaded -----------------------------------------------------------


def full_run(like: Path, out: Path, model: Path) -> Path:
    """A finished full-finetune run directory whose model is `model` (a directory of weights)."""
    text = (like / "config.toml").read_text()
    out.mkdir(parents=True)
    (out / "config.toml").write_text(text.replace('method = "lora"', 'method = "full"'))
    shutil.copytree(model, out / "model")
    return out


def test_refusals(qwen3, tmp_path):
    run = qwen3[0]
    full = full_run(run, tmp_path / "full", run / "base")
    with pytest.raises(ConfigError, match="full finetune, which has no adapter"):
        export_gguf(full, tmp_path / "a.gguf", "float32", adapter_only=True)
    dora = tmp_path / "dora"
    shutil.copytree(run, dora, ignore=shutil.ignore_patterns("base", "manifest.json"))
    settings = json.loads((dora / "adapter" / "adapter_config.json").read_text())
    (dora / "adapter" / "adapter_config.json").write_text(json.dumps({**settings, "use_dora": True}))
    with pytest.raises(ConfigError, match="DoRA magnitude"):
        export_gguf(dora, tmp_path / "a.gguf", "float32", adapter_only=True)
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(ConfigError, match=r"not ending in \.gguf"):
        export_gguf(run, tmp_path / "notes.txt", "float32", adapter_only=False)
    with pytest.raises(ConfigError, match="would write over its adapter"):
        export_gguf(run, run / "adapter" / "x.gguf", "float32", adapter_only=False)
    with pytest.raises(ConfigError, match="float32, float16, bfloat16"):
        export_gguf(run, tmp_path / "a.gguf", "int8", adapter_only=False)
    with pytest.raises(ConfigError, match="not a distft run directory"):
        export_gguf(tmp_path, tmp_path / "a.gguf", "float32", adapter_only=False)
    assert not list(tmp_path.glob("*.gguf*"))


# ---- llama.cpp itself ----------------------------------------------------------------------------


def llama_cpp_logits(path: Path, ids: list[int], lora: Path | None = None, new: int = 0):
    """llama.cpp's logits at every position of `ids` and its `new` greedy tokens after them, its KV
    cache in float32 (its f16 default rounds attention by ~2e-3, which would only widen a tolerance)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    f32 = 0  # GGML_TYPE_F32
    llm = llama_cpp.Llama(
        model_path=str(path), lora_path=str(lora) if lora else None, n_ctx=128, n_threads=1,
        logits_all=True, type_k=f32, type_v=f32, verbose=False,
    )  # fmt: skip
    try:
        assert llm.tokenize(TEXT.encode(), add_bos=False, special=True) == ids  # its own tokenizer agrees
        llm.eval(ids)
        found = torch.from_numpy(np.array(llm.scores[: len(ids)]))
        greedy = llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)
        return found, [next(greedy) for _ in range(new)]
    finally:
        llm.close()


def test_llama_cpp_runs_the_merged_file_as_transformers_does(qwen3):
    """llama.cpp loads the merged Qwen3 file, tokenizes as the tokenizer does, computes the same
    logits (measured: 2e-6 apart in float32) and decodes the same 8 greedy tokens."""
    pytest.importorskip("llama_cpp")
    _, merged, tokenizer, path, _ = qwen3
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    found, greedy = llama_cpp_logits(path, ids, new=8)
    torch.testing.assert_close(found, logits(merged, ids), rtol=0, atol=1e-4)
    expected = list(ids)
    for _ in range(8):  # transformers' greedy decoding, not stopped at an end-of-turn token
        expected.append(int(logits(merged, expected)[-1].argmax()))
    assert greedy == expected[len(ids) :]


def test_llama_cpp_applies_the_adapter_as_peft_does(llama, qwen3, tmp_path):
    """The Llama base written whole (as a full-finetune run of it) and the adapter written alone:
    llama.cpp adds (alpha / r) B A to the permuted q/k and computes the PEFT model's logits.
    Left out, the q/k permutation moves these logits by ~0.9, the rope factors by ~6e-3, and B's
    permutation by ~0.2 (measured)."""
    pytest.importorskip("llama_cpp")
    run, peft_model, _ = llama
    base = export_gguf(
        full_run(run, tmp_path / "base-run", run / "base"), tmp_path / "base.gguf", "float32", False
    )
    adapter = export_gguf(run, tmp_path / "adapter.gguf", "float32", adapter_only=True)
    ids = qwen3[2].encode(TEXT, add_special_tokens=False)  # the preset keeps Qwen3's tokenizer
    expected = logits(peft_model, ids)
    torch.testing.assert_close(llama_cpp_logits(base, ids, lora=adapter)[0], expected, rtol=0, atol=1e-4)
    with peft_model.disable_adapter():
        without = logits(peft_model, ids)
    torch.testing.assert_close(llama_cpp_logits(base, ids)[0], without, rtol=0, atol=1e-4)
    assert (without - expected).abs().max() > 1e-2  # the adapter is what is tested


def test_the_command_line_writes_gguf_and_refuses_what_only_gguf_takes(qwen3, tmp_path, capsys):
    from distft.cli import main

    run = str(qwen3[0])
    out = tmp_path / "adapter.gguf"
    assert (
        main(
            [
                "export",
                "--run",
                run,
                "--out",
                str(out),
                "--format",
                "gguf",
                "--adapter-only",
                "--dtype",
                "q8_0",
            ]
        )
        == 0
    )
    assert f"to {out} (GGUF, adapter, q8_0)" in capsys.readouterr().out and out.is_file()
    reader = gguf.GGUFReader(out)  # B's rows of r=16 values are no q8_0 block: float16, as the converter
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["blk.0.attn_q.weight.lora_a"] == "Q8_0" and kinds["blk.0.attn_q.weight.lora_b"] == "F16"
    assert field(reader, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q8_0
    for flags, said in [
        (["--adapter-only"], "--adapter-only is for --format gguf"),
        (["--dtype", "float16"], "--dtype float16 is for --format gguf"),
        (["--format", "gguf", "--push-to-hub", "me/x"], "push a GGUF file with huggingface-cli upload"),
    ]:
        assert main(["export", "--run", run, "--out", str(tmp_path / "x"), *flags]) == 2
        assert said in capsys.readouterr().err
