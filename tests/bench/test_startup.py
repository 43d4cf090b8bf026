"""`distft bench --startup`'s bound and report, from fabricated measurements (the runs themselves
are `distft train`, which tests/data/test_cache.py runs at 100k rows)."""

from distft.bench.startup import StartupSettings, check_bound, write_startup_report


def measured(rows: int, warm_s: list[float], rank_data_s: float = 0.002) -> dict:
    def mode(startups: list[float], **extra) -> dict:
        runs = [
            {"startup_s": s, "rank_data_s": rank_data_s, "examples_read": 8, "load_1min": 1.0, **extra}
            for s in startups
        ]
        return {"startup_s": sorted(startups)[len(startups) // 2], "startup_min_s": min(startups),
                "startup_max_s": max(startups), "runs": runs}  # fmt: skip

    return {"rows": rows, "off": mode([20.0]), "cold": mode([15.0], build_s=3.0), "warm": mode(warm_s)}


def test_the_bound_compares_warm_start_ups_with_the_smallest_size():
    settings = StartupSettings(bound_s=5.0)
    assert check_bound(
        [measured(1_000, [10.0, 11.0, 12.0]), measured(100_000, [14.0, 15.0, 30.0])], settings
    )["holds"]
    grows = check_bound([measured(1_000, [10.0]), measured(100_000, [16.0])], settings)
    assert not grows["holds"] and grows["worst_excess_s"] == 6.0
    slow_rank = check_bound([measured(1_000, [10.0]), measured(100_000, [10.0], rank_data_s=2.0)], settings)
    assert not slow_rank["holds"]


def test_the_report_has_a_row_per_size_and_the_verdict(tmp_path):
    rows = [measured(1_000, [10.0, 12.0, 11.0]), measured(100_000, [17.0])]
    settings = StartupSettings(repeats=3)
    summary = {
        "settings": vars(settings),
        "environment": {"cpu_count": 2, "device": "cpu", "torch": "2.13"},
        "rows": rows,
        "bound": check_bound(rows, settings),
    }
    text = write_startup_report(summary, tmp_path).read_text()
    assert "| 1,000 | 20.0 | 15.0 | 3.00 | 11.0 [10.0-12.0] | 2 ms | 8 | 1.0 |" in text
    assert "| 100,000 |" in text and "**FAILS**" in text and (tmp_path / "startup.json").is_file()
