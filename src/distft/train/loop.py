"""The one training loop, shared by every strategy.

Read `train` top to bottom: set-up (`distft.train.setup`: process group, tokenizer, data, model,
strategy, optimizer, resume), `steps_and_export` (the loop: `distft.train.step` for the step
itself, then measuring, evaluating, logging and checkpointing; then export), and the teardown.
The last step is checkpointed before its validation and the export (`after_step`): nothing that
fails after the last update costs the trained weights.
Everything strategy-specific hides behind `Strategy`; everything a test wants to inject hides
behind `TrainHooks`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from distft import signals
from distft.config import Config
from distft.distributed import shutdown
from distft.errors import TrainingError
from distft.io.checkpoint import latest_checkpoint, record_validation, save_training_state
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
    truncate_metrics,
)
from distft.train.optim import training_lines
from distft.train.progress import TrainingProgress
from distft.train.reference import attach_reference
from distft.train.result import TrainResult
from distft.train.setup import Run, setup
from distft.train.step import between_batches, evaluate, expected, global_batch, train_step
from distft.train.tracking import Trackers


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
        run.hooks = hooks
        # From here SIGINT/SIGTERM only ask the run to stop at its next step boundary, or its next
        # batch of a phase without steps: the reference scoring, a validation, the export.
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
    first = run.start_step - (run.pending is not None)  # a pending validation logs its step's record
    trackers = Trackers.open(cfg, first, enabled=env.is_main)  # output.report_to
    result = TrainResult(output_dir=run.out, first_step=run.start_step + 1)
    names = [str(p) for p in run.health.places] if run.health else None
    boundary = StepBoundary.start(env, tc.straggler_window, tc.straggler_ratio, names)

    def log(record: dict, wanted: bool) -> None:
        if metrics and wanted:
            metrics.write(record)
            trackers.log(record)
        progress.update(record)

    # ---- the loop -------------------------------------------------------------------------
    startup_s = startup_seconds()  # command start to the first step
    run.model.train()
    with progress:
        progress.advance_to(first)
        step, last, saved = run.start_step, False, False  # saved: whether the step before was checkpointed
        if run.pending is not None:  # resumed from a checkpoint written before its step's validation
            last, saved = after_step(run, step, run.pending, result, log, pending=True)
        for step in range(run.start_step + 1, tc.max_steps + 1) if not last else ():  # 1-based
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
            last, saved = after_step(run, step, record, result, log)
            if last:
                break

    # ---- export (none when stopped: the run goes on with `--resume`) ------------------------
    ranks = None if result.stopped_by is not None else exported(run, step, result, measure, boundary)
    if env.is_main:
        metrics.close()
        trackers.finish()
    if ranks is None:
        return result
    if env.is_main:
        # Written only so that a failure at the end costs nothing, where no checkpoints are kept.
        if not cfg.output.checkpoint_every and (final := latest_checkpoint(run.out)):
            shutil.rmtree(final, ignore_errors=True)
            with contextlib.suppress(OSError):  # their folder too, unless it holds another
                final.parent.rmdir()
        lines = [compile_line(ranks), *prediction_lines(ranks), result.time_line(cfg.prediction)]
        progress.done(run.out, lines)
    result.model = unwrap(run.model)
    return result


def after_step(
    run: Run, step: int, record: dict, result: TrainResult, log: Callable, pending: bool = False
) -> tuple[bool, bool]:
    """Validate, log and checkpoint step `step`, its update done (`pending`: resumed from its
    checkpoint, written before its validation); (whether the run ends after it, whether it was
    checkpointed). The last step is checkpointed before anything else can fail, with its record
    while its validation is still to run (`distft.io.checkpoint.record_validation`)."""
    tc, every = run.cfg.train, run.cfg.output.checkpoint_every
    end = step == tc.max_steps
    due = bool(tc.eval_batches) and (pending or end or (bool(tc.eval_every) and step % tc.eval_every == 0))
    if end and not pending:
        checkpoint(run, step, record if due else None)
    written = end or pending
    with after_training(run) if written else contextlib.nullcontext():
        try:
            ends = due and validate(run, step, record, result)  # early stopping: this step is the last
        except signals.Interrupted as signal:  # on every rank at the same batch
            stop(run, step, signal.signum, result, written, "validation", record)
            return True, True
        log(record, step % tc.log_every == 0 or end or ends or due)
        if written and due and run.env.is_main:  # the validation's outcome, into the step's checkpoint
            record_validation(latest_checkpoint(run.out), loop_state(run))
    saved = written or ends or (bool(every) and step % every == 0)
    if saved and not written:  # an early stop's last step too: a failed export then costs nothing
        checkpoint(run, step)
    return end or ends, saved


@contextlib.contextmanager
def after_training(run: Run) -> Iterator[None]:
    """Past the checkpoint of the last step: a failure says that the trained weights are safe, and
    how to finish the run (a `TrainingError` names that checkpoint itself: `resume_hint`)."""
    try:
        yield
    except Exception as err:
        if not isinstance(err, TrainingError):
            err.add_note(
                f"The trained weights are safe in {latest_checkpoint(run.out)}: "
                f"`distft train --resume {run.out}` finishes the run."
            )
        raise


def exported(
    run: Run, step: int, result: TrainResult, measure: StepMeasurements, boundary: StepBoundary
) -> list[dict] | None:
    """After the last step, `step`: every rank agrees to stop (None), or exports (`export`)."""
    with after_training(run):
        try:
            between_batches(run, "export", 0)
        except signals.Interrupted as signal:
            stop(run, step, signal.signum, result, True, "export")
            return None
        summary = rank_summary(run, measure.saved_activation_bytes) | measure.rank_record()
        prediction = prediction_record(run, measure)
        return export(run, summary | {"straggler": boundary.of(run.env.rank), **prediction})


# ---- the loop's helpers -------------------------------------------------------------------


def start_outputs(run: Run, progress: TrainingProgress, layout: list[str]) -> MetricsWriter | None:
    """Print the header (and where a resume starts; `layout`: lines on how the strategy placed the
    model, a pipeline's cut); score the reference (`dpo.precompute_reference`); open
    `metrics.jsonl` on the main rank."""
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
        # A pending validation writes its step's record (again, where it got that far).
        truncate_metrics(run.out / "metrics.jsonl", run.start_step - (run.pending is not None))
        skipped = "".join(f"{note}, set aside as .damaged-*; " for note in run.skipped_checkpoints)
        resuming = f"{skipped}resuming from {run.checkpoint} (step {run.start_step})"
        progress.console.print(resuming, soft_wrap=True, markup=False)  # a path stays whole
    attach_reference(run, progress)  # dpo.precompute_reference: scored once, after the header
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


def loop_state(run: Run) -> dict:
    """The loop's own state a checkpoint keeps: early stopping's best validation loss."""
    return {"early_stopping": run.early_stopping.state_dict()}


def checkpoint(run: Run, step: int, pending: dict | None = None) -> Path:
    """Write the training state after step `step` (`distft.io.checkpoint`), every rank its shards,
    with the loop's own state; `pending`: the step's record, its validation still to run."""
    loop = loop_state(run) | ({"pending": pending} if pending is not None else {})
    with run.collective(f"writing the checkpoint of step {step}"):
        state = run.strategy.checkpoint_state(run.model, run.optimizer)
        env, keep = run.env, run.cfg.output.keep_last
        return save_training_state(run.out, step, state, run.scheduler, env.rank, env.world_size, keep, loop)


def stop(
    run: Run,
    step: int,
    signum: int,
    result: TrainResult,
    saved: bool,
    phase: str = "",
    pending: dict | None = None,
) -> None:
    """Stop after step `step` on signal `signum` (before its `phase`, "validation" or "export"):
    checkpoint it (`train.checkpoint_on_signal`, unless `saved` already; `pending`: its record,
    its validation still to run), and say so in `result`."""
    result.stopped_by, result.stopped_after, result.stopped_in = signum, step, phase
    if run.cfg.train.checkpoint_on_signal or saved:
        result.checkpoint = latest_checkpoint(run.out) if saved else checkpoint(run, step, pending)


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
