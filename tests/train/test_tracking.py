"""`output.report_to`: TensorBoard for real (its event files read back), wandb, MLflow and trackio
through fake modules in `sys.modules` (no account, no network), and the check before launch."""

import importlib.machinery
import json
import sys
import types

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from distft.cli import main
from distft.config import load_config
from distft.errors import ConfigError
from distft.train import train
from distft.train.tracking import Trackers, check_trackers, flat_params, numeric_fields

QUICK = [
    "model.name=micro",
    "train.max_steps=3",
    "train.global_batch_size=2",
    "train.micro_batch_size=2",
    "train.eval_every=2",
    "train.eval_batches=1",
    "data.max_length=384",
    "data.max_rows=8",
]


def test_tensorboard_events_equal_metrics_jsonl(tmp_path):
    train(load_config(None, [*QUICK, f"output.dir={tmp_path}", 'output.report_to=["tensorboard"]']))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [r["step"] for r in records] == [1, 2, 3]
    # TensorBoard stores scalars as float32: equal to metrics.jsonl's float64, rounded once.
    assert [e.value for e in loss] == [torch.tensor(r["loss"], dtype=torch.float32).item() for r in records]
    assert set(events.Tags()["scalars"]) == {name for r in records for name in numeric_fields(r)}
    assert [e.step for e in events.Scalars("eval_loss")] == [2, 3]
    assert "config/text_summary" in events.Tags()["tensors"]  # the resolved config, as text
    # ... and as the run's hparams (TensorBoard's HPARAMS tab)
    start = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(start).session_start_info.hparams
    assert hparams["model.name"].string_value == "micro" and hparams["train.max_steps"].number_value == 3


def test_a_resumed_run_replaces_the_steps_past_its_checkpoint(tmp_path):
    """Steps 3-4 were logged, the run crashed after its step-2 checkpoint; the resumed run logs step
    3 again (purge_step), and TensorBoard shows its value, not the lost run's."""
    cfg = load_config(None, [f"output.dir={tmp_path}", 'output.report_to=["tensorboard"]'])
    first = Trackers.open(cfg)
    for step in (1, 2, 3, 4):
        first.log({"step": step, "loss": float(step)})
    first.finish()
    resumed = Trackers.open(cfg, start_step=2)
    resumed.log({"step": 3, "loss": 30.0})
    resumed.finish()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_numeric_fields_flatten_and_skip_flags():
    record = {"step": 4, "loss": 1.5, "tokens": 10, "skipped": True, "comm_bytes": {"all_reduce": 8}}
    assert numeric_fields(record) == {"loss": 1.5, "tokens": 10.0, "comm_bytes/all_reduce": 8.0}
    params = flat_params(load_config(None, ["lora.target_modules=q_proj,v_proj"]))
    assert params["lora.target_modules"] == "q_proj,v_proj" and params["optim.lr"] == 1e-2


def fake_module(monkeypatch, name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # what find_spec reports for it
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


RECORDS = [
    {"step": 1, "loss": 2.0, "lr": 1e-3, "skipped": True},
    {"step": 2, "loss": 1.5, "lr": 2e-3, "eval_loss": 1.7, "comm_bytes": {"all_reduce": 64}},
]
LOGGED = [(1, {"loss": 2.0, "lr": 1e-3}), (2, {"loss": 1.5, "lr": 2e-3, "eval_loss": 1.7, "comm_bytes/all_reduce": 64.0})]  # fmt: skip


def feed(cfg) -> None:
    trackers = Trackers.open(cfg)
    for record in RECORDS:
        trackers.log(record)
    trackers.finish()


def test_wandb_gets_the_config_and_every_record(monkeypatch, tmp_path):
    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    fake_module(monkeypatch, "wandb", init=init)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    feed(load_config(None, [f"output.dir={tmp_path / 'r1'}", "output.report_to=wandb"]))
    (_, init_args), *logs, finish = calls
    assert init_args["project"] == "distft" and init_args["name"] == "r1"
    assert init_args["config"]["optim"]["lr"] == 1e-2 and init_args["config"]["output"]["report_to"] == [
        "wandb"
    ]
    assert [(step, data) for _, step, data in logs] == LOGGED
    assert finish == ("finish",)


def test_mlflow_gets_params_and_metrics_by_step(monkeypatch, tmp_path):
    calls = []
    fake_module(
        monkeypatch,
        "mlflow",
        set_experiment=lambda name: calls.append(("experiment", name)),
        start_run=lambda run_name: calls.append(("start", run_name)),
        log_params=lambda params: calls.append(("params", params)),
        log_metrics=lambda metrics, step: calls.append(("metrics", step, metrics)),
        end_run=lambda: calls.append(("end",)),
    )
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    feed(load_config(None, [f"output.dir={tmp_path}", "output.report_to=mlflow", "output.run_name=baseline"]))
    assert calls[:2] == [("experiment", "distft"), ("start", "baseline")]
    assert calls[2][0] == "params" and calls[2][1]["train.method"] == "lora"
    assert [(step, data) for _, step, data in calls[3:5]] == LOGGED
    assert calls[5:] == [("end",)]


def test_trackio_gets_the_config_and_every_record(monkeypatch, tmp_path):
    calls = []
    fake_module(
        monkeypatch,
        "trackio",
        init=lambda **kwargs: calls.append(("init", kwargs)),
        log=lambda metrics, step: calls.append(("log", step, metrics)),
        finish=lambda: calls.append(("finish",)),
    )
    monkeypatch.delenv("TRACKIO_PROJECT", raising=False)
    feed(load_config(None, [f"output.dir={tmp_path}", "output.report_to=trackio", "output.run_name=r2"]))
    assert calls[0][1]["project"] == "distft" and calls[0][1]["name"] == "r2"
    assert calls[0][1]["config"]["train"]["method"] == "lora"
    assert [(step, data) for _, step, data in calls[1:3]] == LOGGED
    assert calls[3:] == [("finish",)]


def test_off_the_main_rank_nothing_is_opened(monkeypatch, tmp_path):
    fake_module(monkeypatch, "wandb", init=lambda **kwargs: pytest.fail("rank > 0 opened wandb"))
    trackers = Trackers.open(load_config(None, ["output.report_to=wandb"]), enabled=False)
    trackers.log(RECORDS[0])
    trackers.finish()


def test_a_missing_library_is_a_config_error_naming_pip(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what find_spec reports for an absent module
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ConfigError, match=r"`pip install wandb mlflow`"):
        check_trackers(load_config(None, ["output.report_to=wandb,mlflow"]))
    with pytest.raises(ConfigError, match="Did you mean `tensorboard`"):
        load_config(None, ["output.report_to=tensorbord"])


def test_the_cli_refuses_before_launch(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "trackio", None)
    code = main(["train", "--model", "micro", "--out", str(tmp_path / "run"), "output.report_to=trackio"])
    assert code == 2
    err = capsys.readouterr().err
    assert "pip install trackio" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists(), "nothing ran"
