"""How often the loop measures collectives (`train.measure_comm`)."""

from tests.helpers import PARITY, distft, metrics


def test_measure_comm_first_measures_only_the_first_step(tmp_path):
    out = tmp_path / "ddp"
    distft(
        "train", "--strategy", "ddp", "--nproc", "2", *PARITY, "train.measure_comm=first", "--out", str(out)
    )
    records = metrics(out)
    assert len(records) == 3
    first, *rest = records
    assert first["comm_bytes"] == first["comm_bytes_expected"] and "overlap_fraction" in first
    assert all("comm_bytes" not in r and "overlap_fraction" not in r for r in rest)
