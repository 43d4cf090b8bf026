import os
import subprocess
from pathlib import Path

import pytest

from distft.config import Config, config_differences, load_config, to_toml
from distft.errors import ConfigError
from distft.parallel import batch_shape, check_config

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.toml"))


def test_defaults_are_the_embedded_cpu_run():
    cfg = load_config()
    assert cfg.model.name == "tiny"
    assert cfg.parallel.strategy == "single"
    assert cfg.data.source == "sample"
    assert batch_shape(cfg).accumulation_steps == cfg.train.global_batch_size // cfg.train.micro_batch_size


def test_file_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[optim]\nlr = 1e-4\n[lora]\nrank = 4\ntarget_modules = ["q_proj"]\n')
    cfg = load_config(path, ["optim.lr=3e-4", "train.method=full", "lora.target_modules=q_proj,v_proj"])
    assert cfg.optim.lr == 3e-4  # the override wins over the file
    assert cfg.lora.rank == 4
    assert cfg.train.method == "full"
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]


def test_the_pipeline_split_is_a_name_or_a_list(tmp_path):
    """parallel.pp_split: balanced (default), even, or layers per stage, from TOML, an override as
    TOML ([5,3]) or comma-separated (5,3); it round-trips through the saved config."""
    assert load_config().parallel.pp_split == "balanced"
    path = tmp_path / "run.toml"
    path.write_text("[parallel]\npp_split = [5, 3]\n")
    assert load_config(path).parallel.pp_split == [5, 3]
    for override in ("parallel.pp_split=[2,1,1]", "parallel.pp_split=2,1,1"):
        assert load_config(None, [override]).parallel.pp_split == [2, 1, 1]
    cfg = load_config(None, ["parallel.pp_split=even"])
    assert cfg.parallel.pp_split == "even"
    path.write_text(to_toml(load_config(path)))
    assert load_config(path).parallel.pp_split == [5, 3]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("count", "`parallel.pp_split` is 'count'; choose balanced, even, or a list"),
        ("[4,0]", "`parallel.pp_split` is [4, 0]: every pipeline stage needs at least one decoder layer"),
        ("[2.5,1]", "`parallel.pp_split` must be an integer, got 2.5"),
        ("[true]", "`parallel.pp_split` must be an integer, got True"),
    ],
)
def test_a_bad_pipeline_split_is_refused(value, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"parallel.pp_split={value}"])
    assert str(err.value).startswith(message), err.value


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["optim.lr=5e-4", 'data.system_prompt=Say "hi"\\n', "output.dir=runs/x"])
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    again = load_config(path)
    assert config_differences(cfg, again) == []
    assert again.data.system_prompt == cfg.data.system_prompt


@pytest.mark.parametrize(
    ("text", "overrides", "expected"),
    [
        ("[optim]\nlr = \n", [], "line 2"),  # malformed TOML names line and column
        ("[optim]\nwarmup_step = 5\n", [], "Did you mean `optim.warmup_steps`?"),
        ("", ["optim.lrr=1e-4"], "Unknown config key `optim.lrr`. Did you mean `optim.lr`?"),
        ("", ["optim.scheduler=cosine_with_restarts"], "constant. Did you mean `cosine`?"),
        ("[optimizer]\nlr = 1e-4\n", [], "Did you mean `optim`?"),
        ("lr = 1e-4\n", [], "must be a [section] table"),
        ("optim = 3\n", [], "`optim` must be a [section] table ([optim] then its keys)."),
        ("", ["train.max_steps=ten"], "must be an integer"),
        ("", ["train.max_steps=0"], "must be positive"),
        ("", ["lora.rank=-1"], "`lora.rank` must be positive"),
        ("", ["train.method=qlora2"], "choose one of lora, qlora, full"),
        ("", ["parallel.strategy=zero9"], "parallel.strategy"),
        ("", ["optim.lr"], "section.key=value"),
        ("", ["model.autocast=maybe"], "true or false"),
        ("", ["train.global_batch_size=6", "train.micro_batch_size=4"], "multiple of"),
        ("", ["data.truncation=random"], "head, tail, middle"),
        ("", ['model.added_tokens=["<|a|>",""]'], "model.added_tokens holds '': an added token needs text"),
        ("", ['model.added_tokens=["  "]'], "model.added_tokens holds '  '"),
    ],
)
def test_errors_are_clear(tmp_path, text, overrides, expected):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        check_config(load_config(path, overrides))  # field checks, then the strategy's
    assert expected in str(err.value)
    assert "\n" not in str(err.value).strip()  # one paragraph


@pytest.mark.parametrize(("value", "hint"), [("bogus", None), ("zero3", "Did you mean `zero2`?")])
def test_a_bad_choice_lists_the_choices_once(value, hint):
    with pytest.raises(ConfigError) as err:
        check_config(load_config(None, [f"parallel.strategy={value}"]))
    message = str(err.value)
    assert message.count("ddp+pp") == 1 and "Valid:" not in message, message
    assert message.startswith(f"`parallel.strategy` is '{value}'; choose one of cp, ddp, ddp+pp, fsdp")
    assert (hint in message) if hint else message.endswith("zero2.")


def test_strategy_help_lists_the_strategies():
    from distft.cli import build_parser
    from distft.parallel import STRATEGIES

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    (action,) = [a for a in train._actions if "--strategy" in a.option_strings]
    assert all(name in action.help for name in STRATEGIES)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("nope.toml")
    with pytest.raises(ConfigError, match="is a directory; give a TOML file"):
        load_config(tmp_path)
    assert load_config("/dev/null") == Config()  # an empty file, as `--config /dev/null` means
    pipe = tmp_path / "config.toml"  # as `--config <(...)` gives it
    os.mkfifo(pipe)
    writer = subprocess.Popen(["sh", "-c", f"printf '[optim]\\nlr = 0.5\\n' > {pipe}"])
    assert load_config(pipe).optim.lr == 0.5
    writer.wait(timeout=10)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_parses(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# distft "), "each config starts with the command that runs it"
    assert isinstance(load_config(path), Config)
