"""Settings a run would not read are said before launch, a warning each (`unread_settings`): the
[dpo] settings its objective has no use for, the [moe] ones on a model without experts,
trust_remote_code on a preset. What the run does read is never named."""

import pytest

from distft.cli import main
from distft.config import load_config
from distft.model import model_config
from distft.train.preflight import READ_BY_OBJECTIVE, unread_settings


def said(overrides: list[str], model: str = "micro") -> list[str]:
    cfg = load_config(None, [f"model.name={model}", *overrides])
    return unread_settings(cfg, model_config(model))


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (["dpo.beta=0.2"], "dpo.beta=0.2 does nothing under train.objective=sft: only dpo, orpo, kto read it."),
        (["train.objective=orpo", "dpo.loss_type=ipo"], "dpo.loss_type=ipo does nothing under train.objective=orpo: only dpo reads it."),
        (["train.objective=dpo", "dpo.desirable_weight=2"], "dpo.desirable_weight=2.0 does nothing under train.objective=dpo: only kto reads it."),
        (["train.objective=orpo", "dpo.precompute_reference=true"], "dpo.precompute_reference=true does nothing under train.objective=orpo: only dpo, kto read it."),
        (["moe.aux_loss_coef=0.01"], "moe.aux_loss_coef=0.01 does nothing: micro has no mixture of experts."),
        (["model.trust_remote_code=true"], "model.trust_remote_code=true does nothing: the preset micro is built"),
    ],
)  # fmt: skip
def test_a_setting_the_run_never_reads_is_said(overrides, line):
    (got,) = said(overrides)
    assert got.startswith(line)


def test_what_the_run_reads_is_never_named():
    for key, readers in READ_BY_OBJECTIVE.items():
        for objective in readers:
            value = {"precompute_reference": "true", "loss_type": "ipo"}.get(
                key, "64" if "length" in key else "0.3"
            )
            assert said([f"train.objective={objective}", f"dpo.{key}={value}"]) == [], (key, objective)
    assert said(["moe.aux_loss_coef=0.01", "moe.z_loss_coef=0.001"], "qwen3-moe-micro") == []
    assert said([]) == []


def test_the_cli_prints_them_as_warnings_before_launch(tmp_path, capsys):
    run = ["train", "--model", "micro", "--dry-run", "dpo.beta=0.2", "moe.z_loss_coef=0.01"]
    assert main([*run, "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "distft train: warning: dpo.beta=0.2 does nothing under train.objective=sft" in err
    assert "distft train: warning: moe.z_loss_coef=0.01 does nothing: micro has no mixture of experts." in err
