"""The one training loop, shared by every strategy.

Read `train` top to bottom: set-up (`distft.train.setup`: process group, tokenizer, data, model,
strategy, optimizer, resume), `steps_and_export` (the loop: `distft.train.step` for the step
itself, then measuring, evaluating, logging and checkpointing; then export), and the teardown.
Everything strategy-specific hides behind `Strategy`; everything a test wants to inject hides
behind `TrainHooks`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from distft import signals
from distft.config import Config
from distft.distributed import shutdown
from distft.io.checkpoint import latest_checkpoint, resume_hint, save_training_state
from distft.io.files import atomic_write_text
from distft.io.lock import run_lock
from distft.io.save import save_adapter, save_full_model
from distft.measure.step import StepMeasurements
from distft.model import DTYPES, causal_lm
from distft.model.nf4 import quantization
from distft.parallel.base import unwrap
from distft.parallel.derive import complete_defaults
from distft.train.boundary import StepBoundary
from distft.train.hooks import TrainHooks
from distft.train.metrics import (
    MetricsWriter,
    compile_line,
    gather_rank_summaries,
    prediction_lines,
    prediction_record,
    rank_summary,
    speed_line,
    startup_seconds,
    step_record,
    step_time_line,
    truncate_metrics,
)
from distft.train.optim import training_lines
from distft.train.progress import TrainingProgress
from distft.train.reference import attach_reference
from distft.train.setup import Run, setup
from distft.train.step import evaluate, expected, global_batch, train_step
from distft.train.tracking import Trackers


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)  # measured, seconds per step
    predicted_step_times: list[float | None] = field(default_factory=list)  # the planner's (None: no peak)
    eval_losses: dict[int, float] = field(default_factory=dict)
    output_dir: Path | None = None
    model: torch.nn.Module | None = None  # this rank's trained `LossLM` (unwrapped)
    early_stop: dict | None = None  # why validation ended the run (`distft.train.early_stopping`)
    stopped_by: int | None = None  # the signal that stopped the run early (`distft.signals`)
    stopped_after: int = 0  # ... after this step
    checkpoint: Path | None = None  # ... having written this checkpoint (None: none written)
    first_step: int = 1  # the first step this command ran (a resumed run's is past 1)

    def add(self, record: dict) -> None:
        """One step's figures (its `metrics.jsonl` record): its loss, measured and predicted time."""
        self.losses.append(record["loss"])
        self.step_times.append(record["step_time_s"])
        self.predicted_step_times.append(record["step_time_predicted_s"])

    def time_line(self, prediction: dict | None) -> str:
        return step_time_line(prediction, self.step_times, self.predicted_step_times, self.first_step)

    def stopped_line(self, max_steps: int) -> str:
        """The one line a run stopped by a signal ends with: where, what was saved, how to go on."""
        head = f"distft train: stopped by {signals.name(self.stopped_by)} after step {self.stopped_after} of {max_steps}"
        if self.checkpoint is None:
            hint = resume_hint(self.output_dir)
            return f"{head}; no checkpoint written (train.checkpoint_on_signal=false). {hint}"
        return f"{head}; checkpoint written to {self.checkpoint}. Resume with: distft train --resume {self.output_dir}"


def train(cfg: Config, hooks: TrainHooks | None = None, dataset: Any = None) -> TrainResult:
    """Train as `cfg` says; `hooks` run at fixed points of every step (none by default); `dataset`
    (a list of dicts, a `datasets.Dataset`, or a dict of splits) replaces `cfg.data.source`."""
    hooks = hooks or TrainHooks()
    # What `distft train` derives, for a config built in Python too (a no-op in its ranks).
    complete_defaults(cfg)
    # Rank 0 holds the run directory's lock (`distft.io.lock`), unless the command that launched it does.
    lock = run_lock(Path(cfg.output.dir)) if os.environ.get("RANK", "0") == "0" else contextlib.nullcontext()
    with lock:
        run = setup(cfg, dataset, hooks.health)
        attach_reference(run)  # DPO with dpo.precompute_reference: scored once, before the first step
        # From here SIGINT/SIGTERM only ask the loop to stop at its next step boundary.
        with signals.deferred():
            result = steps_and_export(run, hooks)
            env = run.env
            # The parallel model goes before the process group. DDP's C++ reducer holds a reference
            # to the group; were it the last, dropping the model would destroy gloo's threads with
            # the GIL held while one of them waits for the GIL to free a tensor: a hang (seen in 1
            # forked run of ~10 under load). Left to `destroy_process_group`, the last reference
            # goes without the GIL.
            del run
            gc.collect()  # the wrappers sit in reference cycles
            shutdown(env)
    return result


def steps_and_export(run: Run, hooks: TrainHooks) -> TrainResult:
    """The loop over steps (measuring, evaluating, logging, checkpointing), then the export."""
    # ---- outputs --------------------------------------------------------------------------
    cfg, env, tc = run.cfg, run.env, run.cfg.train
    progress = TrainingProgress(enabled=env.is_main, total_steps=tc.max_steps)
    measure = StepMeasurements(run.strategy, run.model, run.start_step + 1, expected(run), run.out)
    metrics = start_outputs(run, progress, measure.header_lines())
    trackers = Trackers.open(cfg, run.start_step, enabled=env.is_main)  # output.report_to
    result = TrainResult(output_dir=run.out, first_step=run.start_step + 1)
    names = [str(p) for p in run.health.places] if run.health else None
    boundary = StepBoundary.start(env, tc.straggler_window, tc.straggler_ratio, names)

    # ---- the loop -------------------------------------------------------------------------
    startup_s = startup_seconds()  # command start to the first step
    run.model.train()
    with progress:
        progress.advance_to(run.start_step)
        saved = False  # whether the step before this one was checkpointed
        for step in range(run.start_step + 1, tc.max_steps + 1):  # 1-based
            hooks.before_step(step, env.rank)
            examples = global_batch(run, step)
            # Stragglers named; every rank stops after the same step (`distft.train.boundary`).
            with run.collective(f"the all-reduce of arrival times and stop signals before step {step}"):
                findings, signum = boundary.cross(step)
            for finding in findings:
                progress.warn(boundary.window.message(finding))
            if signum and step > run.start_step + 1:
                stop(run, step - 1, signum, result, saved)
                break
            if env.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with measure.watch(step):
                loss, grad_norm, updated = train_step(run, examples, step, hooks.after_backward)
            if env.device.type == "cuda":  # the step's time includes the optimizer's kernels
                torch.cuda.synchronize()
            record = step_record(run, step, examples, loss, grad_norm, time.perf_counter() - t0)
            record.update(measure.report(step, examples))
            if step == run.start_step + 1:  # the header's last line: start-up time and MFU
                record["startup_s"] = startup_s
                if progress.enabled:
                    progress.console.print(speed_line(run, record), soft_wrap=True)
            result.add(record)
            if not updated:
                record["skipped"] = True  # non-finite loss or gradient norm (train.on_nonfinite=skip)
                if progress.enabled:
                    progress.console.print(f"step {step}: loss {loss}, grad_norm {grad_norm}: skipped")
            last = step == tc.max_steps
            if tc.eval_batches and ((tc.eval_every and step % tc.eval_every == 0) or last):
                last |= validate(run, step, record, result)  # early stopping: this step is the last
            if metrics and (step % tc.log_every == 0 or last or "eval_loss" in record):
                metrics.write(record)
                trackers.log(record)
            progress.update(record)
            # The last step too: a finished run is extended (`--resume DIR --max-steps N`) from it.
            saved = bool(cfg.output.checkpoint_every) and (step % cfg.output.checkpoint_every == 0 or last)
            if saved:
                checkpoint(run, step)
            if last:
                break

    if result.stopped_by is not None:  # no export: the run goes on with `--resume`
        if env.is_main:
            metrics.close()
            trackers.finish()
        return result

    # ---- export ---------------------------------------------------------------------------
    straggler = boundary.of(env.rank)
    summary = rank_summary(run, measure.saved_activation_bytes) | measure.rank_record()
    prediction = prediction_record(run, measure)
    summary |= {"straggler": straggler, **prediction}
    ranks = export(run, summary)
    if env.is_main:
        metrics.close()
        trackers.finish()
        lines = [compile_line(ranks), *prediction_lines(ranks), result.time_line(cfg.prediction)]
        progress.done(run.out, lines)
    result.model = unwrap(run.model)
    return result


# ---- the loop's helpers -------------------------------------------------------------------


def start_outputs(run: Run, progress: TrainingProgress, layout: list[str]) -> MetricsWriter | None:
    """Print the header (and where a resume starts; `layout`: lines on how the strategy placed the
    model, a pipeline's cut); open `metrics.jsonl` on the main rank."""
    cfg, env = run.cfg, run.env
    progress.header(
        cfg,
        world_size=env.world_size,
        device=str(env.device),
        backend=env.backend or "none",
        params=run.parameters,
        batch=(run.shape.micro_batch_size, run.shape.accumulation_steps, run.shape.data_parallel_size),
        data={"train": run.train_set.summary(), "validation": run.val_set.summary()},
        lineage=run.lineage,
        kernels=kernels_line(run),
        training=training_lines(run.cfg, len(run.train_set)),
        layout=layout,
    )
    if run.health is not None and progress.enabled:
        progress.console.print(run.health.summary(), soft_wrap=True)
        for warning in run.health.warnings():
            progress.warn(warning)
    if env.is_main and run.start_step:
        truncate_metrics(run.out / "metrics.jsonl", run.start_step)
        skipped = "".join(f"{note}, set aside as .damaged-*; " for note in run.skipped_checkpoints)
        resuming = f"{skipped}resuming from {run.checkpoint} (step {run.start_step})"
        progress.console.print(resuming, soft_wrap=True, markup=False)  # a path stays whole
    return MetricsWriter(run.out / "metrics.jsonl", append=run.start_step > 0) if env.is_main else None


def kernels_line(run: Run) -> str:
    """The header's promise, before anything compiled: the attention kernel, and whether the
    decoder layers will compile (the line after step 1 says what did)."""
    cfg = run.cfg.model
    compiling = f"decoder layers to compile with {cfg.compile_backend} at step 1" if run.compiled else "eager"
    return f"attention {run.attention} (model.attn_implementation={cfg.attn_implementation}); {compiling}"


def validate(run: Run, step: int, record: dict, result: TrainResult) -> bool:
    """The validation loss after step `step`, into `record` and `result`; True when early stopping
    ends the run after this step (`distft.train.early_stopping`), on every rank alike: the loss is
    the same float on each (`evaluate`)."""
    with run.collective(f"the all-reduce of the validation loss after step {step}"):
        loss = record["eval_loss"] = result.eval_losses[step] = evaluate(run)
    record.update(run.statistics)  # a preference objective's validation pairs: accuracy, margin, ...
    if not run.early_stopping.update(loss, step) or step == run.cfg.train.max_steps:
        return False  # improving, or the last step anyway: an ordinary end
    record["early_stop"] = result.early_stop = run.early_stopping.record(step, loss)
    return True


def checkpoint(run: Run, step: int) -> Path:
    """Write the training state after step `step` (`distft.io.checkpoint`), every rank its shards,
    with the loop's own state (early stopping's best validation loss)."""
    loop = {"early_stopping": run.early_stopping.state_dict()}
    with run.collective(f"writing the checkpoint of step {step}"):
        state = run.strategy.checkpoint_state(run.model, run.optimizer)
        env, keep = run.env, run.cfg.output.keep_last
        return save_training_state(run.out, step, state, run.scheduler, env.rank, env.world_size, keep, loop)


def stop(run: Run, step: int, signum: int, result: TrainResult, saved: bool) -> None:
    """Stop after step `step` on signal `signum`: checkpoint it (`train.checkpoint_on_signal`,
    unless `saved` already), and say so in `result`."""
    result.stopped_by, result.stopped_after = signum, step
    if run.cfg.train.checkpoint_on_signal:
        result.checkpoint = latest_checkpoint(run.out) if saved else checkpoint(run, step)


def export(run: Run, summary: dict) -> list[dict]:
    """Gather the trained weights and every rank's summary; the main rank writes them. Returns
    every rank's summary."""
    with run.collective("gathering the trained weights for export"):
        ranks = gather_rank_summaries(run.env, summary)
        state = run.strategy.trainable_state_dict(run.model)
    if not run.env.is_main:
        return ranks
    lm = unwrap(run.model).lm
    if run.cfg.train.method in ("lora", "qlora"):
        changed = run.cfg.data.chat_template or run.cfg.model.added_tokens  # the base's tokenizer, altered
        save_adapter(
            lm,
            state,
            run.out / "adapter",
            run.base_ref,
            quantization(run.cfg),
            run.tokenizer if changed else None,
        )
    else:  # in the model's dtype: fp32 master weights (train.master_weights) export as bf16
        state = {k: v.to(DTYPES[run.cfg.model.dtype]) for k, v in state.items()}
        save_full_model(causal_lm(lm), state, run.out / "model", run.tokenizer, run.lineage)
    atomic_write_text(run.out / "ranks.json", json.dumps(ranks, indent=1))
    return ranks
