"""`lora.target_modules` presets (attention, mlp, all, all-linear) pass the checks before launch
for every family, on the command line and in TOML; a misspelt name is refused in one line with
the name it was probably meant to be. Each run is `distft train --dry-run` in this process: the
checks and the plan, nothing trained."""

from __future__ import annotations

import pytest

from distft.cli import main
from distft.config import load_config
from distft.io.preflight import output_bytes
from distft.model.build import model_config

PRESETS = ["attention", "mlp", "all", "all-linear"]
DRY = ["data.max_rows=8", "--dry-run"]


@pytest.mark.parametrize("model", ["micro", "llama-micro", "qwen2-micro"])
@pytest.mark.parametrize("preset", PRESETS)
def test_every_documented_preset_passes_the_checks_before_launch(model, preset, tmp_path, capsys):
    argv = ["train", "--model", model, f"lora.target_modules={preset}", "--out", str(tmp_path), *DRY]
    assert main(argv) == 0, capsys.readouterr().err
    assert "dry run: every check before launch passed" in capsys.readouterr().out


def test_a_preset_in_toml_passes_too(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text('[lora]\ntarget_modules = ["all-linear"]\n')
    argv = ["train", "--config", str(config), "--model", "micro", "--out", str(tmp_path / "run"), *DRY]
    assert main(argv) == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    ("typo", "meant"), [("all-linaer", "all-linear"), ("atention", "attention"), ("qproj", "q_proj")]
)
def test_a_misspelt_target_is_refused_in_one_line_with_a_suggestion(typo, meant, tmp_path, capsys):
    argv = ["train", "--model", "micro", f"lora.target_modules={typo}", "--out", str(tmp_path), *DRY]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = err.splitlines()
    assert line.startswith(
        f"distft train: error: `lora.target_modules` names {typo}, which micro does not have"
    )
    assert line.endswith(f"Did you mean `{meant}`?")


def test_the_disk_estimate_counts_the_projections_a_preset_names():
    """A preset is priced as its projections, not as a layer name no module has (zero adapters)."""
    micro = model_config("micro")
    preset = output_bytes(load_config(None, ["lora.target_modules=attention"]), micro)
    names = output_bytes(load_config(None, ["lora.target_modules=q_proj,k_proj,v_proj,o_proj"]), micro)
    assert preset == names and preset["export"] > 0
