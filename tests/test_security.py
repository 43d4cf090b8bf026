"""What a run writes holds no secret from the environment, and no file is left writable by others.

A training (with checkpoints), an export and a refused run, each with tokens and keys set to marker
values: no marker may appear in any file under the run and the export, nor in anything printed
(docs/security.md). The planted-pickle tests are in tests/test_checkpoint.py.
"""

import os
import stat

from tests.helpers import distft, run_cli

SECRETS = {
    "HF_TOKEN": "hf_marker_7c1f0a",
    "WANDB_API_KEY": "wandb_marker_93ab2e",
    "MY_SERVICE_SECRET": "secret_marker_51d2c4",
    "DATABASE_PASSWORD_KEY": "key_marker_0be817",
}
RUN = [
    "--model", "micro",
    "train.max_steps=2",
    "train.global_batch_size=4",
    "data.max_rows=16",
    "data.max_length=256",
    "--checkpoint-every", "1",
]  # fmt: skip


def test_no_secret_is_written_and_no_file_is_world_writable(tmp_path):
    out, export = tmp_path / "run", tmp_path / "export"
    printed = [
        distft("train", *RUN, "--out", str(out), env=SECRETS),
        distft("export", "--run", str(out), "--out", str(export), env=SECRETS),
        run_cli("train", *RUN, "--out", str(out), env=SECRETS),  # refused: a finished run
    ]
    assert printed[-1].returncode == 2
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) > 10 and any(p.name == "config.toml" for p in files)
    for marker in SECRETS.values():
        for proc in printed:
            assert marker not in proc.stdout + proc.stderr
        for path in files:
            assert marker.encode() not in path.read_bytes(), f"{marker} written to {path}"
    umask = os.umask(0)
    os.umask(umask)
    for path in [*files, *(p for p in tmp_path.rglob("*") if p.is_dir())]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert not mode & stat.S_IWOTH, f"{path} is writable by others ({oct(mode)})"
        assert not mode & umask, f"{path} ignores the umask {oct(umask)} ({oct(mode)})"
