"""What a run prints: a header with the batch arithmetic and data summary, then a progress bar.

Only the logging rank prints. Loss lines are also printed at intervals, so a log file (where the
bar does not animate) still shows the loss falling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from distft.config import Config
from distft.config.choices import ITEM_NAMES, batch_unit
from distft.data import data_format, data_name, skipped_line
from distft.data.pairs import rows_per_item
from distft.io.lineage import describe, is_random
from distft.model import is_preset
from distft.parallel.derive import derived_line
from distft.text import console, plural
from distft.train.early_stopping import stop_line


class TrainingProgress:
    def __init__(self, enabled: bool, total_steps: int):
        self.enabled = enabled
        self.total = total_steps
        self.console = console()
        self.print_every = max(1, total_steps // 10)
        self._progress: Progress | None = None
        self._task = None

    def header(
        self,
        cfg: Config,
        world_size: int,
        device: str,
        backend: str,
        params: tuple[int, int],
        batch: tuple[int, int, int],
        data: dict[str, dict[str, float]],
        lineage: dict | None = None,
        kernels: str = "",
        training: list[str] | None = None,
        layout: list[str] | None = None,
    ) -> None:
        if not self.enabled:
            return
        micro, accum, dp = batch
        trainable, total = params
        c = self.console
        origin = (lineage or {}).get("origin", {})
        commit = f" at commit {origin['commit'][:12]}" if origin.get("commit") else ""
        c.print(
            f"[bold]distft[/bold] {cfg.train.method} finetune of [bold]{cfg.model.name}[/bold]{commit}"
            f"{_objective_words(cfg)} ({total / 1e6:.1f}M parameters, "
            f"{trainable / 1e6:.2f}M trainable, {cfg.model.dtype})",
            soft_wrap=True,
        )
        c.print(
            f"strategy {cfg.parallel.strategy}: {plural(world_size, 'process')} on {device}, backend {backend}"
        )
        for line in layout or []:  # how the strategy placed the model (a pipeline's cut)
            c.print(line, soft_wrap=True, markup=False)
        if kernels:
            c.print(kernels, soft_wrap=True)
        if cfg.model.trust_remote_code and not is_preset(cfg.model.name):  # a preset runs transformers' code
            c.print(
                f"[yellow]model.trust_remote_code=true:[/yellow] {cfg.model.name}'s own Python code runs in "
                "this process (docs/security.md)",
                soft_wrap=True,
            )
        sequences = rows_per_item(cfg.train.objective)  # a pair's two
        tokens = cfg.train.global_batch_size * sequences * cfg.data.max_length
        c.print(
            f"global batch {cfg.train.global_batch_size}{batch_unit(cfg.train.objective)} = micro-batch "
            f"{micro} x accumulation {accum} x data-parallel ranks {dp}; up to {tokens:,} tokens per "
            "optimizer step" + (f" ({sequences} sequences a pair)" if sequences > 1 else ""),
            soft_wrap=True,
        )
        why = cfg.derived.get("optim.lr", "").partition(": ")[2]
        c.print(f"learning rate {cfg.optim.lr:g}" + (f" (derived: {why})" if why else " (optim.lr)"))
        if line := derived_line(cfg):
            c.print(line, soft_wrap=True)
        for line in training or []:  # optimizer, schedule, LoRA variant, epochs, hints (`train.optim`)
            c.print(line, soft_wrap=True, markup=False)
        c.print(data_table(cfg, data))
        if line := skipped_line(data):
            c.print(line, soft_wrap=True, markup=False)
        if is_random(lineage):  # a random preset or its descendant: say so before the first loss
            c.print(describe(lineage, cfg.output.dir), soft_wrap=True)
        elif not is_preset(cfg.model.name) and cfg.optim.lr > 1e-3:  # a pretrained base
            c.print(
                f"[yellow]warning:[/yellow] optim.lr={cfg.optim.lr:g} is the default for random presets; "
                "pretrained checkpoints usually want 1e-4 to 2e-4."
            )

    def __enter__(self) -> TrainingProgress:
        if self.enabled:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[tps]} tok/s"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task("train", total=self.total, loss="-", tps="-")
        return self

    def advance_to(self, step: int) -> None:
        if self._progress:
            self._progress.update(self._task, completed=step)

    def update(self, record: dict[str, Any]) -> None:
        if not self._progress:
            return
        self._progress.update(
            self._task, advance=1, loss=f"{record['loss']:.4f}", tps=f"{record['tokens_per_s']:,.0f}"
        )
        step = record["step"]
        if step == 1 or step % self.print_every == 0 or "eval_loss" in record:
            line = (
                f"step {step:>5}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
                f"grad_norm {record['grad_norm']:.3f}  {record['tokens_per_s']:,.0f} tok/s"
            )
            # A preference objective's: how far the chosen answers' reward leads, how often it does.
            if record.get("margin") is not None:
                line += f"  margin {record['margin']:+.3f}"
            if record.get("accuracy") is not None:
                line += f"  accuracy {record['accuracy']:.0%}"
            if "eval_loss" in record:
                line += f"  eval_loss {record['eval_loss']:.4f}"
            if record.get("eval_accuracy") is not None:
                line += f"  eval_accuracy {record['eval_accuracy']:.0%}"
            self._progress.console.print(line, soft_wrap=True)  # one step, one line
        if "early_stop" in record:  # the run's last step: validation stopped improving
            self._progress.console.print(stop_line(record["early_stop"]), soft_wrap=True, markup=False)

    @contextlib.contextmanager
    def counting(self, label: str, total: int, unit: str) -> Iterator[Callable[[int], None]]:
        """A bar of `total` `unit`s for work before the first step (the reference scored), drawn
        as the steps' bar is, on the logging rank; yields what advances it."""
        if not self.enabled:
            yield lambda n: None
            return
        columns = (TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit))
        with Progress(*columns, TimeRemainingColumn(), console=self.console) as bar:
            task = bar.add_task(label, total=total)
            yield lambda n: bar.update(task, advance=n)

    def note(self, message: str) -> None:
        """A line, on the logging rank only."""
        if self.enabled:
            self.console.print(message, soft_wrap=True, markup=False)

    def warn(self, message: str) -> None:
        """A warning line, on the logging rank only."""
        if self.enabled:
            self.console.print(f"[yellow]warning:[/yellow] {message}", soft_wrap=True)

    def __exit__(self, *exc: object) -> None:
        if self._progress:
            self._progress.__exit__(*exc)

    def done(self, out: Path, summary: list[str] | None = None) -> None:
        """The end of a run: `summary`'s lines, then what the run directory holds."""
        if self.enabled:
            for line in summary or []:
                self.console.print(line, soft_wrap=True)
            entries = sorted(
                p.name + ("/" if p.is_dir() else "") for p in out.iterdir() if not p.name.startswith(".")
            )
            self.console.print(f"wrote {out}/: {', '.join(entries)}", soft_wrap=True, markup=False)


def _objective_words(cfg: Config) -> str:
    """What the header adds for a preference objective (an SFT run's says nothing more)."""
    if cfg.train.objective == "sft":
        return ""
    return f" toward the preferred answers, {cfg.train.objective.upper()} (dpo.beta {cfg.dpo.beta:g})"


def data_table(cfg: Config, data: dict[str, dict[str, float]]) -> Table:
    """The header's table of the splits: rows (pairs, KTO's examples), their tokens, what was cut."""
    item = ITEM_NAMES[cfg.train.objective]  # a pair counts once, its tokens per sequence
    table = Table(
        "split",
        f"{item}s",
        "tokens (median / max)",
        f"truncated {item}s",
        "tokens cut (mean / max)",
        # the format: what `data.format=auto` made of the rows (`distft data preview` shows them)
        title=f"data: {data_name(cfg.data)}, format {data_format(cfg.data)}, max_length "
        f"{cfg.data.max_length}, truncation {cfg.data.truncation}",
        title_justify="left",
    )
    for split, s in data.items():
        table.add_row(
            split,
            str(s["rows"]),
            f"{s['tokens_median']:.0f} / {s['tokens_max']}",
            str(s["truncated_rows"]),
            f"{s['truncated_tokens_mean']:.0f} / {s['truncated_tokens_max']}",
        )
    return table
