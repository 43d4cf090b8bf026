"""The bench plots' readability rules, on fabricated results: no legend over the data, byte axes
from zero (or log when the bytes span orders of magnitude), integer steps on the loss plot."""

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.ticker import MaxNLocator

from distft.bench.plots import (
    plot_comm,
    plot_losses,
    plot_memory,
    plot_pp_gantt,
    plot_pp_idle,
    plot_throughput,
)
from tests.bench.fabricated import sweep_run


def _result(strategy: str, comm_bytes: dict[str, int], tokens: float) -> dict:
    rank = {"rank": 0, "param_bytes": {"dense": 40 * 2**20}, "grad_bytes": 2**19, "optimizer_bytes": 2**20,
            "saved_activation_bytes": 100 * 2**20, "peak_mem_bytes": 2**30}  # fmt: skip
    return {
        "strategy": strategy,
        "ranks": [rank, {**rank, "rank": 1}] if strategy != "single" else [rank],
        "comm_bytes": comm_bytes,
        "tokens_per_s": {"median": tokens, "min": tokens * 0.8, "max": tokens * 1.1},
        "repeats": [{"tokens_per_s": {"median": tokens * f}} for f in (0.8, 1.0, 1.1)],
        "losses": [2.0, 1.8, 1.7, 1.65, 1.6],
    }


RESULTS = [
    _result("single", {}, 800),
    _result("ddp", {"all_reduce": 340_000}, 1500),  # LoRA gradients: 0.3 MiB
    _result("fsdp", {"all_gather": 160 * 2**20, "reduce_scatter": 690_000}, 1100),  # the base: 160 MiB
]


def _legends_clear_of_the_data(fig) -> None:
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is not None:
            box, area = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
            assert not box.overlaps(area), f"legend over the data in {ax.get_title()!r}"


def test_bytes_axes_start_at_zero_or_go_log(tmp_path):
    fig = plot_memory(RESULTS, tmp_path / "memory.png")
    assert fig.axes[0].get_ylim()[0] == 0
    _legends_clear_of_the_data(fig)

    fig = plot_comm(RESULTS, tmp_path / "comm.png")  # 0.3 MiB against 160 MiB: log
    assert fig.axes[0].get_yscale() == "log"
    _legends_clear_of_the_data(fig)
    close = [RESULTS[0], RESULTS[1], _result("zero2", {"all_reduce": 400_000}, 1400)]
    fig = plot_comm(close, tmp_path / "comm2.png")  # within 100x: linear, stacked, from zero
    assert fig.axes[0].get_yscale() == "linear" and fig.axes[0].get_ylim()[0] == 0

    fig = plot_throughput(RESULTS, tmp_path / "throughput.png")
    assert fig.axes[0].get_ylim()[0] == 0
    for name in ("memory.png", "comm.png", "throughput.png"):
        assert 0 < (tmp_path / name).stat().st_size < 150_000, name  # small enough to commit


def test_loss_plot_has_integer_steps_and_an_outside_legend(tmp_path):
    fig = plot_losses(RESULTS, tmp_path / "losses.png")
    ax = fig.axes[0]
    locator = ax.xaxis.get_major_locator()
    assert isinstance(locator, MaxNLocator) and locator._integer
    assert all(t == int(t) for t in ax.get_xticks())
    assert len({line.get_linestyle() for line in ax.get_lines()}) == len(
        RESULTS
    )  # coinciding curves stay visible
    _legends_clear_of_the_data(fig)


def test_pipeline_idle_plot_ticks_the_measured_micro_batch_counts(tmp_path):
    sweep = [{"schedule": s, "microbatches": m, "idle_fraction": 0.4, "idle_fraction_theory": 1 / (m + 1)}
             for s in ("gpipe", "1f1b") for m in (4, 8)]  # fmt: skip
    fig = plot_pp_idle(sweep, tmp_path / "idle.png")
    assert list(fig.axes[0].get_xticks()) == [4, 8]
    assert fig.axes[0].get_ylim() == pytest.approx((0, 1))
    _legends_clear_of_the_data(fig)


def test_pipeline_idle_plot_has_a_panel_per_split_with_the_model_beside_the_measurement(tmp_path):
    sweep = [sweep_run(s, m, split, [2, 2] if split == "even" else [3, 1], idle=(0.45, 0.4), step=(1, 1, 1))
             for s in ("gpipe", "zbv") for m in (2, 4) for split in ("even", "balanced")]  # fmt: skip
    fig = plot_pp_idle(sweep, tmp_path / "idle.png")
    assert [ax.get_title() for ax in fig.axes] == ["even cut", "balanced cut"]
    for ax in fig.axes:  # per schedule: measured, modelled, theory
        assert len(ax.get_lines()) == 2 * 3 and list(ax.get_xticks()) == [2, 4]
    assert fig.axes[1].get_legend() is not None
    _legends_clear_of_the_data(fig)
    fig = plot_pp_gantt(sweep[1]["timeline"], tmp_path / "gantt.png")  # gpipe at m = 2, balanced
    assert "balanced cut 3/1" in fig.axes[0].get_title() and "(cost model: 40%)" in fig.axes[0].get_title()
    assert 0 < (tmp_path / "gantt.png").stat().st_size < 150_000
