"""Building the base: presets initialised in place and in their dtype, and the recipe that rebuilds them."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3ForCausalLM

from distft.cli import main
from distft.config import ModelConfig, load_config
from distft.data.tokenizer import qwen3_tokenizer
from distft.errors import ConfigError
from distft.infer import load_trained
from distft.model import PRESETS, load_base_model
from distft.model.build import base_recipe, rebuild_base
from distft.model.compile import compile_blocks
from distft.model.files import check_weight_files
from distft.model.presets import MICRO_RANKS
from distft.train import train
from tests.helpers import distft

RUN = [
    "model.name=micro",
    "model.seed=7",
    "train.max_steps=2",
    "train.global_batch_size=2",
    "train.micro_batch_size=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "data.max_length=256",
    "data.max_rows=8",
    "optim.warmup_steps=1",
]


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_cpu_float32_preset_is_bitwise_the_plain_seeded_model():
    # The figures and parity tests recorded so far were taken on these exact weights.
    config = PRESETS["micro"].to_config()
    config._attn_implementation = "sdpa"
    torch.manual_seed(3)
    plain = Qwen3ForCausalLM(config)
    assert same_weights(load_base_model(ModelConfig(name="micro", seed=3)), plain)


def test_same_recipe_same_weights_and_the_callers_rng_is_untouched():
    torch.manual_seed(0)
    before = torch.rand(3)
    torch.manual_seed(0)
    a = load_base_model(ModelConfig(name="micro", seed=5))
    assert torch.equal(torch.rand(3), before)  # the init forked the generator
    assert same_weights(a, load_base_model(ModelConfig(name="micro", seed=5)))
    assert not same_weights(a, load_base_model(ModelConfig(name="micro", seed=6)))


def test_bfloat16_preset_is_initialised_in_bfloat16():
    model = load_base_model(ModelConfig(name="micro", dtype="bfloat16"), device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_a_cuda_recipe_is_refused_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    recipe = base_recipe(ModelConfig(name="micro"), "cuda")
    assert recipe["device"] == "cuda"
    with pytest.raises(ConfigError, match="CUDA draws a different random stream"):
        rebuild_base(recipe)


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("recipe")
    return out, train(load_config(None, [*RUN, "output.save_base=false", f"output.dir={out}"]))


def test_a_run_without_base_weights_records_the_recipe(recipe_run):
    out, _ = recipe_run
    assert not (out / "base" / "config.json").exists()
    assert not list((out / "base").glob("*.safetensors"))
    recipe = json.loads((out / "base" / "recipe.json").read_text())
    assert recipe == {
        "preset": "micro",
        "seed": 7,
        "dtype": "float32",
        "attn_implementation": "auto",
        "device": "cpu",
    }


def test_infer_rebuilds_the_trained_base_bitwise(recipe_run):
    out, result = recipe_run
    trained = result.model.lm.get_base_model()  # frozen under LoRA: the base as it was built
    loaded = load_trained(run=str(out))
    rebuilt = loaded.model.get_base_model()
    base_keys = [k for k in trained.state_dict() if "lora_" not in k]
    assert base_keys
    for key in base_keys:
        assert torch.equal(trained.state_dict()[key], rebuilt.state_dict()[key]), key


def test_qwen3_4b_preset_builds_on_the_meta_device_with_the_gpu_settings():
    """What a GPU run builds before its weights exist: Qwen3-4B in bf16, the flex kernel, every
    decoder layer set to compile (nothing compiles until a forward)."""
    model = load_base_model(ModelConfig(name="qwen3-4b", dtype="bfloat16"), "meta")
    assert model.config._attn_implementation == "distft_flex"
    assert 4.0e9 < sum(p.numel() for p in model.parameters()) < 4.1e9  # tied embeddings: 4.02B
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    stats = compile_blocks(model)
    layers = model.model.layers
    assert len(layers) == 36 and all(layer._compiled_call_impl is not None for layer in layers)
    assert stats.graphs == 0 and stats.describe() == "no graph compiled (eager)"


def test_a_model_directory_of_pickles_is_refused_unless_allowed(tmp_path, capsys):
    """Loading a pickle runs what it asks for: a directory with `*.bin` weights only is refused
    before launch, and loads once `model.allow_pickle_weights=true` says the user trusts it."""
    model = load_base_model(ModelConfig(name="micro"))
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"pickles only \(pytorch_model\.bin\).*allow_pickle_weights=true"):
        check_weight_files(ModelConfig(name=str(tmp_path)))
    assert main(["train", "--model", str(tmp_path), "train.max_steps=1", "--out", str(tmp_path / "run")]) == 2
    assert "pickles only" in capsys.readouterr().err
    allowed = ModelConfig(name=str(tmp_path), allow_pickle_weights=True)
    check_weight_files(allowed)
    assert same_weights(load_base_model(allowed), model)


def test_every_model_path_is_named_for_what_it_is_and_damage_is_refused_before_launch(tmp_path, capsys):
    """A path is never taken for a hub id: missing, a file, a config.json that does not parse, a
    safetensors file cut short: each one line, exit 2, before anything loads or launches."""
    model = tmp_path / "model"
    load_base_model(ModelConfig(name="micro")).save_pretrained(model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    cases = [
        (tmp_path / "moved", "Model directory {} does not exist (a path, not a hub id"),
        (weights, "--model {} is a file; give the directory"),
        (model, "{}: model.safetensors holds "),
    ]
    for path, said in cases:
        assert main(["train", "--model", str(path), "--dry-run", "--out", str(tmp_path / "run")]) == 2
        assert said.format(path) in capsys.readouterr().err
    weights.unlink()
    (model / "config.json").write_text('{"model_type": ')  # cut short
    assert main(["train", "--model", str(model), "--dry-run", "--out", str(tmp_path / "run")]) == 2
    assert "its config.json cannot be read" in capsys.readouterr().err


def test_a_runs_base_directory_moved_since_is_said_so_by_every_command_that_loads_it(tmp_path, capsys):
    """A LoRA run on a local model (a stage-1 run's, say) records its path; moved since, infer, eval
    and export say the directory is gone and where the run recorded it, not that the hub is offline."""
    base, run = tmp_path / "stage-1", tmp_path / "stage-2"
    load_base_model(ModelConfig(name="micro")).save_pretrained(base)
    qwen3_tokenizer(MICRO_RANKS).save_pretrained(base)
    settings = ["train.max_steps=1", "data.max_rows=8", "train.global_batch_size=4", "train.eval_batches=0"]
    assert main(["train", "--model", str(base), *settings, "data.max_length=256", "--out", str(run)]) == 0
    base.rename(tmp_path / "elsewhere")
    capsys.readouterr()
    for command in (["infer", "--run", str(run)], ["eval", "--run", str(run), "--rows", "1"],
                    ["export", "--run", str(run), "--out", str(tmp_path / "merged")]):  # fmt: skip
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert f"Model directory {base} does not exist" in err and "base_model_name_or_path" in err, err
        assert "hub" not in err.split("(a path, not a hub id")[1] and "offline" not in err, err


def test_trust_remote_code_is_off_unless_set_and_said_when_on(tmp_path, capsys):
    """On a model directory the header says its code runs; on a preset it does nothing, said so."""
    assert ModelConfig().trust_remote_code is False
    model = tmp_path / "model"
    load_base_model(ModelConfig(name="micro")).save_pretrained(model)
    qwen3_tokenizer(MICRO_RANKS).save_pretrained(model)
    run = [
        "train",
        "train.max_steps=1",
        "data.max_rows=8",
        "train.global_batch_size=4",
        "model.trust_remote_code=true",
    ]
    assert main([*run, "--model", str(model), "--out", str(tmp_path / "dir")]) == 0
    assert f"model.trust_remote_code=true: {model}'s own Python code runs" in capsys.readouterr().out
    assert main([*run, "--model", "micro", "--dry-run", "--out", str(tmp_path / "preset")]) == 0
    err = capsys.readouterr().err
    assert "warning: model.trust_remote_code=true does nothing: the preset micro is built from" in err


# ---- model.revision: a hub model pinned to a commit ---------------------------------------------


def hub_cache(root, repo: str, commits: dict[str, int]) -> None:
    """A Hugging Face hub cache holding `repo` at each commit (its `micro` weights with that many
    layers), the default branch at the last: what `hf download` leaves, read offline."""
    folder = root / f"models--{repo.replace('/', '--')}"
    micro = PRESETS["micro"].to_config()
    for commit, layers in commits.items():
        fields = {**micro.to_dict(), "num_hidden_layers": layers}
        fields.pop("layer_types")  # derived from the layer count
        Qwen3ForCausalLM(type(micro)(**fields)).save_pretrained(folder / "snapshots" / commit)
        qwen3_tokenizer(MICRO_RANKS).save_pretrained(folder / "snapshots" / commit)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)


def test_a_revision_pins_the_commit_and_the_lineage_records_it(tmp_path):
    """The default branch holds a 2-layer model; the run pins the older 1-layer commit, and loads,
    tokenises with and records that one."""
    old, new = "a" * 40, "b" * 40
    hub_cache(tmp_path / "hub", "someone/model", {old: 1, new: 2})
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    short = ["train.max_steps=1", "train.global_batch_size=2", "train.micro_batch_size=2", "data.max_rows=8"]
    out = tmp_path / "run"
    proc = distft("train", "--model", "someone/model", f"model.revision={old}", *short, "--out", str(out), env=env, fresh=True)  # fmt: skip
    origin = json.loads((out / "lineage.json").read_text())["origin"]
    assert origin == {"model": "someone/model", "revision": old, "commit": old, "trust_remote_code": False}
    assert f"finetune of someone/model at commit {old[:12]}" in proc.stdout
    assert "not a real language model" not in proc.stdout  # a pretrained base: no random-preset notice
    assert load_config(out / "config.toml").model.revision == old
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")  # LoRA on every layer loaded: 1
    assert {key.split(".layers.")[1].split(".")[0] for key in adapter} == {"0"}


def test_a_revision_for_a_preset_or_a_directory_is_refused(tmp_path):
    with pytest.raises(
        ConfigError, match=r"model.revision='v1' pins a commit of a hub model, but micro is a preset"
    ):
        check_weight_files(ModelConfig(name="micro", revision="v1"))
    with pytest.raises(ConfigError, match="is a local directory, which has no revisions"):
        check_weight_files(ModelConfig(name=str(tmp_path), revision="v1"))


@pytest.mark.parametrize(
    ("name", "suggested"),
    [("qwen3-mirco", "micro"), ("mirco", "micro"), ("llama-mcro", "llama-micro"), ("Qwen/Qwen3-4Bx", None)],
)
def test_a_misspelt_preset_is_named_before_launch(name, suggested, tmp_path, capsys, monkeypatch):
    """An unknown name without an owner is no hub id: the nearest preset (also as family-preset) is
    offered, in one line; a hub id is never "corrected" to a preset."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["train", "--model", name, "--dry-run", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"distft train: error: Model {name!r} is not a preset")
    assert ("Did you mean" in err) == (suggested is not None)
    if suggested:
        assert f"Did you mean `{suggested}`?" in err
