"""Experiment tracking: the records of `metrics.jsonl`, sent to the trackers in `output.report_to`.

Each tracker is a thin adapter over its library's own API (TensorBoard's `SummaryWriter`,
`wandb.init/log`, `mlflow.log_metrics`, `trackio.init/log`) with three calls: `start` (the
resolved config, as the run's parameters), `log` (one record: every numeric field, by step) and
`finish`. Only the main rank opens trackers, so a run of N processes is one run in the tracker.

Libraries are imported when a tracker starts, never at module import: none of them is a
dependency of distft. `check_trackers` runs in the CLI's preflight, so a tracker that is not
installed is a one-paragraph `ConfigError` naming the pip command before any process launches.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

from distft.config import Config, to_toml
from distft.errors import ConfigError

PROJECT = "distft"  # the wandb project / MLflow experiment / trackio project, unless the env names one


def numeric_fields(record: dict, prefix: str = "") -> dict[str, float]:
    """Every number in `record` but `step` (the x axis), nested dicts flattened with `/`:
    `{"comm_bytes": {"all_reduce": 8}}` -> `{"comm_bytes/all_reduce": 8.0}`. Flags such as
    `skipped` are booleans, not measurements, and are left out."""
    flat: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(numeric_fields(value, f"{name}/"))
        elif isinstance(value, int | float) and not isinstance(value, bool) and name != "step":
            flat[name] = float(value)
    return flat


def flat_params(cfg: Config) -> dict[str, str | int | float | bool]:
    """The resolved config as `section.key` -> value; a list of plain values becomes a
    comma-separated string, a table (`data.roles`) or a list of tables (`data.sources`) its JSON
    (what TensorBoard's hparams and MLflow's params accept: scalars and strings)."""
    params: dict[str, str | int | float | bool] = {}
    for section, table in dataclasses.asdict(cfg).items():
        for key, value in table.items():
            if isinstance(value, dict) or (
                isinstance(value, list) and any(isinstance(v, dict) for v in value)
            ):
                value = json.dumps(value, sort_keys=True)
            elif isinstance(value, list):
                value = ",".join(map(str, value))
            params[f"{section}.{key}"] = value
    return params


class Tracker(abc.ABC):
    """One experiment tracker. Subclasses name the module they need and the package that has it."""

    module = ""  # what `start` imports
    package = ""  # what `pip install` needs for it

    def __init__(self, cfg: Config, start_step: int = 0):
        self.cfg = cfg
        self.out = Path(cfg.output.dir)
        self.run_name = cfg.output.run_name or self.out.resolve().name
        self.start_step = start_step  # a resumed run's first step is start_step + 1

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def log(self, record: dict) -> None: ...

    @abc.abstractmethod
    def finish(self) -> None: ...


class TensorBoard(Tracker):
    """Event files in `DIR/tensorboard` (`tensorboard --logdir DIR/tensorboard`)."""

    module, package = "tensorboard", "tensorboard"

    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        # purge_step: a resumed run hides what the crashed one logged past its checkpoint.
        purge = self.start_step + 1 if self.start_step else None
        self.writer = SummaryWriter(str(self.out / "tensorboard"), purge_step=purge)
        self.writer.add_text("config", "```toml\n" + to_toml(self.cfg) + "```")
        # The hparams plugin's summaries, written into this run (add_hparams would open a second one).
        for summary in hparams(flat_params(self.cfg), {}):
            self.writer.file_writer.add_summary(summary)

    def log(self, record: dict) -> None:
        for name, value in numeric_fields(record).items():
            self.writer.add_scalar(name, value, record["step"])

    def finish(self) -> None:
        self.writer.close()


class WandB(Tracker):
    """A Weights & Biases run (`wandb login`, or WANDB_API_KEY / WANDB_MODE=offline)."""

    module, package = "wandb", "wandb"

    def start(self) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", PROJECT),
            name=self.run_name,
            config=dataclasses.asdict(self.cfg),
            dir=str(self.out),
        )

    def log(self, record: dict) -> None:
        self.run.log(numeric_fields(record), step=record["step"])

    def finish(self) -> None:
        self.run.finish()


class MLflow(Tracker):
    """An MLflow run in the experiment `distft` (MLFLOW_TRACKING_URI says where; default ./mlruns)."""

    module, package = "mlflow", "mlflow"

    def start(self) -> None:
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT))
        mlflow.start_run(run_name=self.run_name)
        mlflow.log_params(flat_params(self.cfg))

    def log(self, record: dict) -> None:
        self.mlflow.log_metrics(numeric_fields(record), step=record["step"])

    def finish(self) -> None:
        self.mlflow.end_run()


class Trackio(Tracker):
    """A trackio run (local by default; `trackio show` opens the dashboard)."""

    module, package = "trackio", "trackio"

    def start(self) -> None:
        import trackio

        self.trackio = trackio
        trackio.init(
            project=os.environ.get("TRACKIO_PROJECT", PROJECT),
            name=self.run_name,
            config=dataclasses.asdict(self.cfg),
        )

    def log(self, record: dict) -> None:
        self.trackio.log(numeric_fields(record), step=record["step"])

    def finish(self) -> None:
        self.trackio.finish()


TRACKER_CLASSES: dict[str, type[Tracker]] = {
    "tensorboard": TensorBoard,
    "wandb": WandB,
    "mlflow": MLflow,
    "trackio": Trackio,
}  # keys: `distft.config.choices.TRACKERS`


def check_trackers(cfg: Config) -> None:
    """Every tracker in `output.report_to` is importable, or one `ConfigError` naming the pip command."""
    missing = [
        TRACKER_CLASSES[name].package
        for name in dict.fromkeys(cfg.output.report_to)
        if importlib.util.find_spec(TRACKER_CLASSES[name].module) is None
    ]
    if missing:
        raise ConfigError(
            f"output.report_to names {', '.join(missing)}, not installed for this Python "
            f"({sys.executable}). Install {'it' if len(missing) == 1 else 'them'} with "
            f"`pip install {' '.join(missing)}`, or leave {'it' if len(missing) == 1 else 'them'} out of "
            "output.report_to."
        )


class Trackers:
    """The trackers of one run, fed together; empty (every call a no-op) off the main rank."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    @classmethod
    def open(cls, cfg: Config, start_step: int = 0, enabled: bool = True) -> Trackers:
        if not enabled:
            return cls([])
        check_trackers(cfg)  # a Python caller may not have gone through the CLI's preflight
        trackers = [TRACKER_CLASSES[name](cfg, start_step) for name in dict.fromkeys(cfg.output.report_to)]
        for tracker in trackers:
            tracker.start()
        return cls(trackers)

    def log(self, record: dict) -> None:
        for tracker in self.trackers:
            tracker.log(record)

    def finish(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
