"""Every shipped config loads, passes the checks `distft train` runs before launch, and opens with
the command that runs it."""

from pathlib import Path

import pytest

from distft.cli import main
from distft.config import load_config
from distft.model import PRESETS, model_config
from distft.parallel import check_config, check_model

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))


def _architecture(name: str):
    # Hub ids stand for their released architecture, which a preset mirrors (no download in CI).
    mirrors = {p.hub_id: key for key, p in PRESETS.items() if p.hub_id}
    # A config that trains on another config's output (the demo's LoRA stage on runs/demo-base/model)
    # stands for that config's model: the directory exists only once the first one has run.
    outputs = {f"{load_config(p, []).output.dir}/model": load_config(p, []).model.name for p in CONFIGS}
    return model_config(mirrors.get(name, outputs.get(name, name)))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_is_runnable(path: Path):
    cfg = load_config(path, [])
    shape = check_config(cfg)
    check_model(cfg, _architecture(cfg.model.name))
    assert shape.accumulation_steps >= 1
    first = path.read_text().splitlines()[0]
    assert first.startswith(f"# distft train --config configs/{path.name}"), first


def test_every_strategy_of_the_series_has_a_real_scale_config():
    strategies = {load_config(p, []).parallel.strategy for p in CONFIGS if p.stem.startswith("qwen3-4b")}
    assert {"single", "ddp", "fsdp", "tp", "tp-sp", "pp"} <= strategies


def test_a_staged_config_run_before_its_first_stage_says_which_run_to_make(tmp_path, monkeypatch, capsys):
    """configs/demo-dpo.toml before `make demo`: its model is stage 1's output, not yet made."""
    monkeypatch.chdir(tmp_path)
    staged = [p for p in CONFIGS if load_config(p, []).model.name.endswith("/model")]
    assert staged, "no shipped config trains on another run's output"
    for path in staged:
        name = load_config(path, []).model.name
        assert main(["train", "--config", str(path), "--dry-run"]) == 2
        err = capsys.readouterr().err
        run = name.removesuffix("/model")
        assert f"`distft train --method full --out {run}`): train that run first." in err, err
