"""The one training loop, shared by every strategy.

Read it top to bottom: set-up (process group, tokenizer, data, model, strategy, optimizer), then
`train_step` (forward + backward over this rank's micro-batches, clip, step), then the loop with
logging and evaluation, then export. Everything strategy-specific hides behind `Strategy`:
the loop only asks it to wrap the model, run forward+backward, reduce the loss and gather weights.

Each optimizer step trains on one global batch (`train.global_batch_size` sequences) chosen by
the seed and the step alone; a data-parallel rank takes its slice and accumulates gradients over
its micro-batches. The loss is the mean token loss over the global batch, so a run's numbers do
not depend on the strategy or the process count.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from distft import faults
from distft.checkpoint import (
    MetricsWriter,
    atomic_write_text,
    check_resume,
    clear_checkpoints,
    load_training_state,
    resume_hint,
    save_adapter,
    save_base,
    save_full_model,
    save_training_state,
    truncate_metrics,
)
from distft.config import Config, to_toml
from distft.data import (
    ChatFormatter,
    Example,
    collate,
    count_label_tokens,
    global_batch_indices,
    load_rows,
    rank_micro_batches,
    tokenize_rows,
)
from distft.data.tokenizer import load_tokenizer
from distft.distributed import (
    DistEnv,
    init_distributed,
    naming_collective,
    restart_count,
    shutdown,
)
from distft.errors import NonFiniteError
from distft.measure.activations import SavedActivations
from distft.measure.comm import CommCounter
from distft.measure.expected import expected_comm_bytes
from distft.measure.pipeline import PipelineTimeline
from distft.model import SummaryLM, apply_method, causal_lm, count_parameters, is_preset, load_base_model
from distft.model.nf4 import quantization, storage_layout
from distft.parallel import STRATEGIES, Strategy, check_config
from distft.parallel.base import unwrap
from distft.parallel.pipeline import PipelineParallel
from distft.progress import TrainingProgress


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    eval_losses: dict[int, float] = field(default_factory=dict)
    output_dir: Path | None = None
    model: torch.nn.Module | None = None  # this rank's trained `SummaryLM` (unwrapped)


def lr_lambda(cfg: Config):
    """Linear warm-up to the peak, then cosine decay to `min_lr_ratio` of it at the last step."""
    warmup, total, floor = cfg.optim.warmup_steps, cfg.train.max_steps, cfg.optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup - 1)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def peak_memory_bytes(env: DistEnv) -> int:
    if env.device.type == "cuda":
        return torch.cuda.max_memory_allocated(env.device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def local_bytes(tensors) -> int:
    """Bytes of these tensors' local storage (a DTensor counts its shard on this rank only)."""
    return sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in tensors)


def gather_rank_summaries(env: DistEnv, summary: dict) -> list[dict]:
    """Every rank's end-of-run figures (peak memory, activation bytes), on every rank."""
    if not env.distributed:
        return [summary]
    gathered: list[dict | None] = [None] * env.world_size
    dist.all_gather_object(gathered, summary)
    return gathered  # type: ignore[return-value]


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def rank_batches(
    examples: list[Example], strategy: Strategy, cfg: Config, pad_id: int
) -> list[dict[str, torch.Tensor]]:
    pad_to = cfg.data.max_length if strategy.fixed_sequence_length else None
    micro = rank_micro_batches(examples, strategy.dp_rank, strategy.dp_size, strategy.micro_batch_size(cfg))
    return [to_device(collate(mb, pad_id, pad_to), strategy.env.device) for mb in micro]


def train(cfg: Config) -> TrainResult:
    # ---- set-up ---------------------------------------------------------------------------
    strategy_cls = STRATEGIES[cfg.parallel.strategy]
    env = init_distributed(cfg.train.device, cfg.parallel.timeout_s, need_group=strategy_cls.distributed)
    strategy = strategy_cls(cfg, env)
    out = Path(cfg.output.dir)
    progress = TrainingProgress(enabled=strategy.is_logging_rank(), total_steps=cfg.train.max_steps)

    tokenizer = load_tokenizer(None if is_preset(cfg.model.name) else cfg.model.name)
    formatter = ChatFormatter(tokenizer, cfg.data)
    rows = load_rows(cfg.data, seed=cfg.train.seed)
    train_set, val_set = tokenize_rows(rows["train"], formatter), tokenize_rows(rows["validation"], formatter)

    base = load_base_model(cfg.model)
    strategy_cls.validate_model(cfg, base.config)
    if env.is_main:
        atomic_write_text(out / "config.toml", to_toml(cfg))
        if is_preset(cfg.model.name) and cfg.output.save_base:
            save_base(base, tokenizer, out / "base")
    base_ref = str((out / "base").resolve()) if is_preset(cfg.model.name) else cfg.model.name

    torch.manual_seed(cfg.train.seed)  # LoRA's random init: identical on every rank
    lm = apply_method(base, cfg)
    if cfg.model.activation_checkpointing:
        causal_lm(lm).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainable, total = count_parameters(lm)
    model = strategy.parallelize(SummaryLM(lm))
    timeline = PipelineTimeline(strategy, out) if isinstance(strategy, PipelineParallel) else None
    param_bytes = storage_layout(model)  # this rank's parameters at rest, NF4 parts apart (distft.model.nf4)
    # Gradients are freed after every step, each with its (sharded) parameter's shape: counted here,
    # before a forward-only pass can leave ZeRO-2's parameters gathered.
    grad_bytes = local_bytes(p for p in model.parameters() if p.requires_grad)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params,
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    use_autocast = cfg.model.autocast and env.device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if use_autocast else contextlib.nullcontext()

    def collective(what: str):  # a timeout or a lost peer names this rank and `what`
        def advice() -> str:
            return f"{resume_hint(out)} If the wait was legitimate, raise parallel.timeout_s."

        return naming_collective(env, what, cfg.parallel.timeout_s, advice)

    start_step = 0
    # An elastic restart (torchrun --max-restarts) resumes its own run even with output.resume=false.
    checkpoint = check_resume(cfg, force=restart_count() > 0)
    if checkpoint is None and env.is_main and restart_count() == 0:
        clear_checkpoints(out)  # starting over: the old run's checkpoints would outrank ours
    if checkpoint is not None:
        with collective(f"loading {checkpoint}"):
            state = strategy.checkpoint_state(model, optimizer)
            start_step = load_training_state(checkpoint, state, scheduler, env.rank)
            strategy.load_checkpoint_state(model, optimizer, state)
    accum = check_config(cfg).accumulation_steps
    progress.header(
        cfg,
        world_size=env.world_size,
        device=str(env.device),
        backend=env.backend or "none",
        params=(trainable, total),
        batch=(strategy.micro_batch_size(cfg), accum, strategy.dp_size),
        data={"train": train_set.summary(), "validation": val_set.summary()},
    )
    if env.is_main and start_step:
        truncate_metrics(out / "metrics.jsonl", start_step)
        progress.console.print(
            f"resuming from {checkpoint} (step {start_step})", soft_wrap=True
        )  # a path stays whole
    metrics = MetricsWriter(out / "metrics.jsonl", append=start_step > 0) if env.is_main else None
    pad_id = tokenizer.pad_token_id

    # ---- one optimizer step ---------------------------------------------------------------
    def train_step(examples: list[Example], step: int) -> tuple[float, float, bool]:
        """Returns (loss, gradient norm, whether the weights were updated); `step` is 1-based."""
        n_tokens = count_label_tokens(examples)
        batches = rank_batches(examples, strategy, cfg, pad_id)
        with autocast, collective(f"{strategy.collectives} in step {step}'s forward/backward"):
            loss_sum = strategy.forward_backward(model, batches, n_tokens)
        faults.poison_gradients(model, step)
        with collective(f"the all-reduces of the gradient norm and the loss in step {step}"):
            grad_norm = strategy.clip_grad_norm_(model, cfg.optim.grad_clip)
            loss = strategy.reduce_loss(loss_sum).item() / n_tokens
        # Both are global (reduced over ranks), so every rank takes the same branch here.
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            optimizer.step()
        elif cfg.train.on_nonfinite == "stop":
            raise NonFiniteError(
                f"Step {step}: the loss is {loss:.4g} and the gradient norm {grad_norm:.4g}; training "
                "diverged, and stopped before the optimizer step, so no weight took the update. "
                f"{resume_hint(out)} Resume with train.on_nonfinite=skip to skip such steps, or lower "
                "optim.lr in a new run."
            )
        scheduler.step()  # a skipped step still counts: the LR stays a function of the step
        optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm, finite

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        gb = cfg.train.global_batch_size
        n_batches = min(cfg.train.eval_batches, len(val_set.examples) // gb)
        loss_sum, n_tokens = torch.zeros((), device=env.device), 0
        for b in range(max(n_batches, 1)):
            examples = val_set.examples[b * gb : (b + 1) * gb]
            n_tokens += count_label_tokens(examples)
            with autocast:
                loss_sum += strategy.forward_only(model, rank_batches(examples, strategy, cfg, pad_id))
        model.train()
        return strategy.reduce_loss(loss_sum).item() / n_tokens

    # ---- the loop -------------------------------------------------------------------------
    result = TrainResult(output_dir=out)
    saved_bytes = 0
    model.train()
    with progress:
        progress.advance_to(start_step)
        for step in range(start_step, cfg.train.max_steps):
            faults.before_step(step + 1, env.rank)  # test-only: off unless DISTFT_FAULT_* is set
            idx = global_batch_indices(
                step, len(train_set.examples), cfg.train.global_batch_size, cfg.train.seed
            )
            examples = [train_set.examples[i] for i in idx]
            if env.device.type == "cuda":
                torch.cuda.synchronize()
            # Collectives are counted on the first step only: the pattern repeats every step, and
            # the counter sees every dispatched op, which would slow the steps it watches.
            first = step == start_step
            counter = CommCounter() if env.distributed and first else contextlib.nullcontext()
            strategy.activation_probe = SavedActivations(model) if first else None
            t0 = time.perf_counter()
            with counter:
                loss, grad_norm, updated = train_step(examples, step + 1)  # .item() waits for the device
            step_time = time.perf_counter() - t0
            tokens = sum(len(e.input_ids) for e in examples)
            result.losses.append(loss)
            record = {
                "step": step + 1,
                "loss": loss,
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": grad_norm,
                "tokens": tokens,
                "tokens_per_s": tokens / step_time,
                "step_time_s": step_time,
                "peak_mem_bytes": peak_memory_bytes(env),
                **strategy.step_report(step + 1),
                **(timeline.report(step + 1) if timeline else {}),
            }
            if not updated:
                record["skipped"] = True  # non-finite loss or gradient norm (train.on_nonfinite=skip)
                if progress.enabled:
                    progress.console.print(f"step {step + 1}: loss {loss}, grad_norm {grad_norm}: skipped")
            if strategy.activation_probe is not None:
                saved_bytes = record["saved_activation_bytes"] = (
                    strategy.activation_probe.bytes
                )  # 1st micro-batch
            if isinstance(counter, CommCounter):
                record["comm_bytes"] = dict(counter.stats.bytes)
                record["comm_calls"] = dict(counter.stats.calls)
                expected = expected_comm_bytes(strategy, model, rank_batches(examples, strategy, cfg, pad_id))
                record["comm_bytes_expected"] = expected
            last = step + 1 == cfg.train.max_steps
            if (cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0) or last:
                with collective(f"the all-reduce of the validation loss after step {step + 1}"):
                    record["eval_loss"] = result.eval_losses[step + 1] = evaluate()
            if metrics and ((step + 1) % cfg.train.log_every == 0 or last or "eval_loss" in record):
                metrics.write(record)
            progress.update(record)
            if cfg.output.checkpoint_every and (step + 1) % cfg.output.checkpoint_every == 0 and not last:
                with collective(f"writing the checkpoint of step {step + 1}"):
                    state = strategy.checkpoint_state(model, optimizer)
                    save_training_state(
                        out, step + 1, state, scheduler, env.rank, env.world_size, cfg.output.keep_last
                    )

    # ---- export ---------------------------------------------------------------------------
    summary = {
        "rank": env.rank,
        "peak_mem_bytes": peak_memory_bytes(env),
        "saved_activation_bytes": saved_bytes,
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "optimizer_bytes": local_bytes(
            v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
        ),
    }
    with collective("gathering the trained weights for export"):
        ranks = gather_rank_summaries(env, summary)
        state = strategy.trainable_state_dict(model)
    if env.is_main:
        lm_unwrapped = unwrap(model).lm
        if cfg.train.method in ("lora", "qlora"):
            save_adapter(lm_unwrapped, state, out / "adapter", base_ref, quantization(cfg))
        else:
            save_full_model(causal_lm(lm_unwrapped), state, out / "model")
        metrics.close()
        atomic_write_text(out / "ranks.json", json.dumps(ranks, indent=1))
        progress.done(out)
    result.model = unwrap(model)
    shutdown(env)
    return result
