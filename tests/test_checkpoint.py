"""Training-state checkpoints: exact resume, atomic writes, pruning, and refusing a foreign run dir."""

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distft.cli import main
from distft.io import checkpoint as checkpoint_module
from distft.io.checkpoint import latest_checkpoint
from distft.io.files import MANIFEST, atomic_directory, write_manifest
from distft.io.safe_load import read_metadata
from tests.helpers import adapter, metrics, run_cli

RUN = [
    "--model", "micro",
    "train.max_steps=6",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.eval_every=0",
    "data.max_rows=32",
    "data.max_length=384",
    "lora.dropout=0.1",  # resuming must restore the RNG too
    # SGD's momentum buffers, a linear schedule and LoRA+'s second param group (its own lr) must
    # come back too (AdamW's exact resume: tests/parallel, fsdp and zero1).
    "optim.name=sgd",
    "optim.scheduler=linear",
    "lora.lr_ratio=4",
]  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("a")
    assert main(["train", *RUN, "--out", str(out)]) == 0
    return out


def test_resume_is_exact(uninterrupted, tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["train", *RUN, "--checkpoint-every", "2", "output.keep_last=3", "--out", str(out)]) == 0
    # Keep the last three complete checkpoints (steps 2, 4 and the last, which extends the run).
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step-000002",
        "step-000004",
        "step-000006",
    ]
    shutil.copytree(out, tmp_path / "finished")
    # Simulate a crash after step 4: drop what came later, then resume.
    shutil.rmtree(out / "adapter")
    shutil.rmtree(out / "checkpoints" / "step-000006")
    shutil.copytree(out, tmp_path / "damaged")
    assert main(["train", "--resume", str(out)]) == 0
    assert [m["loss"] for m in metrics(out)] == [m["loss"] for m in metrics(uninterrupted)]
    a, b = adapter(out), adapter(uninterrupted)
    assert all((a[k] == b[k]).all() for k in b), "bitwise equal in fp32 on CPU"

    # What a copy cut short leaves: half of step 4's shard file. The resume says it skips step 4,
    # resumes from step 2, and still ends bitwise equal to the uninterrupted run.
    out = tmp_path / "damaged"
    shard = out / "checkpoints" / "step-000004" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    capsys.readouterr()
    assert main(["train", "--resume", str(out)]) == 0
    said = capsys.readouterr().out
    assert "skipped the damaged checkpoint step-000004 (__0_0.distcp has" in said
    assert "resuming from " in said and "step-000002 (step 2)" in said
    assert (out / "checkpoints" / ".damaged-step-000004").is_dir()  # set aside, kept for a look
    assert [m["loss"] for m in metrics(out)] == [m["loss"] for m in metrics(uninterrupted)]
    a = adapter(out)
    assert all((a[k] == b[k]).all() for k in b)

    # A finished run extended: from its last step, each step once, and the lines name the steps run.
    out = tmp_path / "finished"
    assert main(["train", "--resume", str(out), "--max-steps", "8"]) == 0
    said = capsys.readouterr().out
    assert "step-000006 (step 6)" in said and "(command start to step 7)" in said and "(step 8)" in said
    assert [m["step"] for m in metrics(out)] == list(range(1, 9))


def test_every_checkpoint_damaged_is_refused_and_nothing_deleted(checkpointed, tmp_path, capsys):
    out, step = fresh_copy(checkpointed, tmp_path)
    (step / "trainer.json").write_text("")  # an empty trainer state
    assert main(["train", "--resume", str(out)]) == 2
    err = capsys.readouterr().err
    assert "every one is damaged: skipped the damaged checkpoint step-000003 (trainer.json has 0 bytes" in err
    assert step.is_dir() and not (out / "adapter").exists()
    (step / MANIFEST).unlink()  # a checkpoint from before manifests: its unreadable trainer state is found
    assert main(["train", "--resume", str(out)]) == 2
    assert "step-000003 (JSONDecodeError: Expecting value" in capsys.readouterr().err
    out, step = fresh_copy(checkpointed, tmp_path / "again")
    (step / MANIFEST).unlink()  # ... and a shard cut short, by the bytes DCP's metadata places in it
    shard = step / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    assert main(["train", "--resume", str(out)]) == 2
    assert "step-000003 (__0_0.distcp has 1,000 bytes, and its metadata places" in capsys.readouterr().err


def test_partial_checkpoint_is_never_loaded(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step-000002").mkdir(parents=True)
    (root / ".step-000004.tmp").mkdir()  # a crash mid-write leaves only this
    assert latest_checkpoint(tmp_path).name == "step-000002"


def test_atomic_directory_keeps_the_old_version_on_failure(tmp_path):
    final = tmp_path / "adapter"
    with atomic_directory(final) as d:
        (d / "weights").write_text("old")
    with pytest.raises(RuntimeError), atomic_directory(final) as d:
        (d / "weights").write_text("half-written")
        raise RuntimeError("disk full")
    assert (final / "weights").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_refuses_to_resume_into_a_different_run(uninterrupted, tmp_path, capsys):
    out = tmp_path / "c"
    assert main(["train", *RUN, "--checkpoint-every", "3", "--out", str(out)]) == 0
    assert main(["train", *RUN, "optim.lr=5e-3", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "different config" in err and "optim.lr: 0.01 -> 0.005" in err


# ---- a checkpoint is data, never code ------------------------------------------------------------


class Planted:
    """What an attacker pickles: unpickling it runs a shell command (here, touching a marker)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """A run stopped after its step-3 checkpoint (its adapter removed), copied fresh for each test."""
    out = tmp_path_factory.mktemp("ckpt")
    assert main(["train", *RUN, "--checkpoint-every", "3", "--out", str(out)]) == 0
    shutil.rmtree(out / "adapter")
    shutil.rmtree(out / "checkpoints" / "step-000006")  # the last step's: a run stopped before it
    return out


def fresh_copy(run: Path, tmp_path: Path) -> tuple[Path, Path]:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out, out / "checkpoints" / "step-000003"


def as_earlier_version(step: Path) -> None:
    """Rewrite a checkpoint's trainer and RNG files in the pickle format earlier versions wrote."""
    trainer = json.loads((step / "trainer.json").read_text())
    torch.save(trainer, step / "trainer.pt")
    (step / "trainer.json").unlink()
    rng = load_file(step / "rng-0.safetensors")
    torch.save({"torch": rng["torch"], "cuda": []}, step / "rng-0.pt")
    (step / "rng-0.safetensors").unlink()
    (step / MANIFEST).unlink()  # earlier versions wrote none


@pytest.mark.parametrize("planted", ["trainer.pt", "rng-0.pt", ".metadata"])
def test_a_planted_pickle_never_runs_on_resume(planted, checkpointed, tmp_path):
    out, step = fresh_copy(checkpointed, tmp_path)
    if planted != ".metadata":
        as_earlier_version(step)  # the pickle files an earlier version wrote, then replaced
    marker = tmp_path / "pwned"
    with (step / planted).open("wb") as f:
        pickle.dump({"step": Planted(marker), "torch": Planted(marker)}, f)
    if (step / MANIFEST).is_file():
        write_manifest(step)  # whoever plants a file can rewrite the manifest too
    proc = run_cli("train", "--resume", str(out))  # its own process: every line a user would see
    assert proc.returncode == 1
    assert not marker.exists(), "the planted pickle ran"
    assert f"{step} cannot be resumed" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (out / "adapter").exists()  # nothing trained from a refused checkpoint


def test_checkpoints_hold_no_pickle_and_earlier_ones_still_resume(checkpointed, uninterrupted, tmp_path):
    out, step = fresh_copy(checkpointed, tmp_path)
    assert sorted(p.name for p in step.iterdir() if not p.name.endswith(".distcp")) == [
        ".metadata",  # DCP's own: read by an unpickler that builds its metadata classes only
        "manifest.json",  # every file's size and SHA-256
        "rng-0.safetensors",
        "trainer.json",
    ]
    as_earlier_version(step)
    assert main(["train", "--resume", str(out)]) == 0
    assert [m["loss"] for m in metrics(out)] == [m["loss"] for m in metrics(uninterrupted)]


def test_hyperparameters_are_one_entry_and_a_checkpoint_of_one_per_parameter_still_resumes(
    checkpointed, uninterrupted, tmp_path, monkeypatch
):
    """LoRA+'s two groups, each its own lr, go into one JSON entry (`distft.io.param_groups`); a
    checkpoint written with an entry per parameter and hyperparameter, as before, resumes exactly."""
    _, step = fresh_copy(checkpointed, tmp_path)
    keys = read_metadata(step).state_dict_metadata
    assert "optim.param_groups" in keys and not any(k.startswith("optim.param_groups.") for k in keys)
    out = tmp_path / "per-parameter"
    monkeypatch.setattr(checkpoint_module, "packed", lambda optim: optim)  # the earlier format
    assert main(["train", *RUN, "--checkpoint-every", "3", "--out", str(out)]) == 0
    monkeypatch.undo()
    keys = read_metadata(out / "checkpoints" / "step-000003").state_dict_metadata
    assert "optim.param_groups" not in keys and any(k.startswith("optim.param_groups.") for k in keys)
    shutil.rmtree(out / "adapter")
    shutil.rmtree(out / "checkpoints" / "step-000006")
    assert main(["train", "--resume", str(out)]) == 0
    assert [m["loss"] for m in metrics(out)] == [m["loss"] for m in metrics(uninterrupted)]
    a, b = adapter(out), adapter(uninterrupted)
    assert all((a[k] == b[k]).all() for k in b), "bitwise equal in fp32 on CPU"
