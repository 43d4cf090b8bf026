"""Atomic directories carry a manifest; `damage` finds the file cut short, altered or missing."""

import json

import pytest

from distft.errors import DamagedFileError
from distft.io.files import MANIFEST, atomic_directory, damage, verify_directory


@pytest.fixture
def written(tmp_path):
    with atomic_directory(tmp_path / "adapter") as d:
        (d / "weights.safetensors").write_bytes(b"w" * 1000)
        (d / "nested").mkdir()
        (d / "nested" / "config.json").write_text("{}")
    return tmp_path / "adapter"


def test_the_manifest_lists_every_file_with_its_size_and_checksum(written):
    files = json.loads((written / MANIFEST).read_text())["files"]
    assert sorted(files) == ["nested/config.json", "weights.safetensors"]
    assert files["weights.safetensors"]["bytes"] == 1000 and len(files["weights.safetensors"]["sha256"]) == 64
    assert damage(written) is None


def test_a_file_cut_short_is_named_with_both_sizes(written):
    (written / "weights.safetensors").write_bytes(b"w" * 10)
    assert damage(written) == "weights.safetensors has 10 bytes, 1,000 when written (cut short or altered)"
    with pytest.raises(
        DamagedFileError, match=r"The adapter .* is damaged: weights.safetensors has 10 bytes"
    ):
        verify_directory(written, "The adapter", "Train it again.")


@pytest.mark.parametrize(
    "harm, found",
    [
        (lambda d: (d / "weights.safetensors").write_bytes(b"x" * 1000), "does not match the checksum"),
        (lambda d: (d / "nested" / "config.json").unlink(), "nested/config.json is missing"),
        (lambda d: (d / MANIFEST).write_text("{"), f"its {MANIFEST} is damaged"),
        (lambda d: (d / MANIFEST).write_text("[]"), f"its {MANIFEST} is damaged"),
    ],
    ids=["same-size-altered", "missing", "manifest-cut", "manifest-not-an-object"],
)
def test_every_kind_of_damage_is_found(written, harm, found):
    harm(written)
    assert found in damage(written)


def test_a_directory_from_before_manifests_is_read_unverified(written):
    (written / MANIFEST).unlink()
    (written / "weights.safetensors").write_bytes(b"")
    assert damage(written) is None  # its readers name what fails to load instead
