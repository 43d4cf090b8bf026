"""Every record carries model FLOPs per token and MFU, and the predicted step time beside the
measured one; the first, the start-up time; the header says why MFU is null."""

import subprocess
import sys
from dataclasses import asdict
from types import SimpleNamespace

import pytest

from distft.config import load_config
from distft.data import ChatFormatter, load_rows, load_tokenizer, tokenize_rows
from distft.measure.flops import ModelFlops, StepTime
from distft.model import apply_method, load_base_model, tokenizer_ranks
from distft.train import train
from distft.train.metrics import predicted_step_seconds, step_time_line
from distft.train.step import global_batch
from tests.helpers import metrics

RUN = [
    "model.name=micro",
    "train.max_steps=3",
    "train.global_batch_size=2",
    "train.micro_batch_size=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "data.max_length=256",
    "data.max_rows=8",
    "optim.warmup_steps=1",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("speed")
    cfg = load_config(None, [*RUN, f"output.dir={out}"])
    return out, cfg


def test_records_carry_flops_per_token_and_a_null_mfu_on_cpu(run, capsys):
    out, cfg = run
    train(cfg)
    header = capsys.readouterr().out
    assert "start-up" in header and "MFU n/a" in header and "null on cpu" in header
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["startup_s"] > 0 and all("startup_s" not in r for r in records[1:])

    flops = ModelFlops.from_model(apply_method(load_base_model(cfg.model), cfg))
    formatter = ChatFormatter(load_tokenizer(None, ranks=tokenizer_ranks(cfg.model.name)), cfg.data)
    train_set = tokenize_rows(load_rows(cfg.data, seed=cfg.train.seed)["train"], formatter)
    data = SimpleNamespace(cfg=cfg, train_set=train_set)  # what `global_batch` reads of a run
    for record in records:
        examples = global_batch(data, record["step"])
        assert record["mfu"] is None
        assert record["step_time_predicted_s"] is None and record["step_time_s"] > 0  # no prediction here
        assert record["flops_per_token"] == pytest.approx(flops.step(examples) / record["tokens"], rel=1e-12)


def test_the_prediction_is_rescaled_to_each_steps_flops():
    """`distft plan`'s step time (its parts, as `Config.prediction` carries them) for this step's FLOPs."""
    prediction = {"step_time": asdict(StepTime(compute_s=2.0, blocking_s=0.5, flops=1000.0))}
    assert predicted_step_seconds(prediction, 500.0) == pytest.approx(1.0 + 0.5)
    assert (
        predicted_step_seconds({"step_time": None, "step_time_note": "no bf16 peak for cpu"}, 500.0) is None
    )
    assert predicted_step_seconds(None, 500.0) is None
    # The end-of-run line: medians over the steps after the first (compile, warm-up).
    line = step_time_line(prediction, [9.0, 1.0, 3.0, 2.0], [1.4, 1.5, 1.6, 1.5])
    assert line == "step time: predicted 1.5 s (distft plan), measured 2 s (median of steps 2-4)"
    cpu = step_time_line({"step_time": None, "step_time_note": "no bf16 peak for cpu"}, [0.2], [None])
    assert cpu == "step time: predicted n/a (no bf16 peak for cpu), measured 0.2 s (step 1)"


def test_start_up_counts_from_the_command_process_start():
    """The clock of a run's `startup_s` starts with the `distft` process, not after its imports:
    the command stamps its process's start time (which the ranks it launches inherit), so that
    start-up includes the imports, as the plain loop's does. Here a second's sleep before the
    import must be counted."""
    probe = (
        "import os, time\n"
        "time.sleep(1.0)\n"
        "import psutil\n"
        "from distft import cli\n"
        "from distft.train.metrics import START_ENV, startup_seconds\n"
        "os.environ.pop(START_ENV, None)\n"
        "cli.run(cli.parse(cli.build_parser(), ['train', '--model', 'micro', '--print-config']))\n"
        "print('stamp', float(os.environ[START_ENV]) == psutil.Process().create_time(), startup_seconds())\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    _, same, seconds = proc.stdout.splitlines()[-1].split()
    assert same == "True" and float(seconds) > 1.0
