"""One optimizer step, and one evaluation, over a global batch of examples.

Each optimizer step trains on one global batch (`train.global_batch_size` sequences) chosen by
the seed and the step alone; a data-parallel rank takes its slice and accumulates gradients over
its micro-batches. The loss is the mean token loss over the global batch, so a run's numbers do
not depend on the strategy or the process count. Everything strategy-specific hides behind
`Strategy`: these functions only ask it to run forward+backward, clip, and reduce the loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from distft import signals
from distft.config import Config
from distft.data import (
    Example,
    count_label_tokens,
    global_batch_indices,
    label_positions,
    micro_batch,
    rank_micro_batches,
)
from distft.data.pairs import blank_items, desirable_of, micro_batch_part, rows_per_item
from distft.errors import NonFiniteError
from distft.io.checkpoint import resume_hint
from distft.model.compile import SEQUENCE_BUCKET, compile_errors_unwrapped, compile_wanted
from distft.model.preference import STATS
from distft.parallel import Strategy
from distft.parallel.base import unwrap
from distft.plan.expected import expected_activations, expected_step_bytes
from distft.train.boundary import agreed_signal
from distft.train.setup import Run

Batch = dict[str, torch.Tensor]


def global_batch(run: Run, step: int) -> list[Example]:
    """The examples of 1-based step `step`: a function of the seed and the step alone."""
    cfg = run.cfg.train
    idx = global_batch_indices(step - 1, len(run.train_set), cfg.global_batch_size, cfg.seed)
    return [run.train_set[i] for i in idx]  # read now: a memory-mapped split holds no rows


def rank_batches(
    examples: list[Example], strategy: Strategy, cfg: Config, pad_id: int, part: str = "train"
) -> list[Batch]:
    """This rank's micro-batches of `examples`, packed or padded (`data.packing`), on its device;
    of a preference objective's, the `part` a forward runs (`distft.data.pairs.micro_batch_part`)."""
    size, packed = strategy.micro_batch_size(cfg), cfg.data.packing
    # One shape every step (pipelines): a sequence of max_length, or a packed row of all the
    # micro-batch's sequences (a pair's two).
    rows = size * rows_per_item(cfg.train.objective)
    pad_to = cfg.data.max_length * (rows if packed else 1) if strategy.spec.fixed_sequence_length else None
    # Compiled code (the blocks, or FlexAttention on CUDA): packed rows in length buckets, so its
    # guards on the length hold (`distft.model.compile`).
    device = strategy.env.device
    compiled = (
        compile_wanted(cfg.model.compile, device, strategy.spec.runs("compile")) or device.type == "cuda"
    )
    multiple = SEQUENCE_BUCKET if compiled else 1
    batches = []
    weight = orpo_token_weight(examples, cfg)
    # Whole micro-batches on every rank: a short batch (validation) filled with blank items.
    examples = blank_items(examples, cfg.train.global_batch_size)
    for mb in rank_micro_batches(examples, strategy.dp_rank, strategy.dp_size, size):
        rows, reference = micro_batch_part(mb, part)  # a pair: its two rows
        batch = micro_batch(rows, pad_id, packed, pad_to, multiple)
        if strategy.spec.takes_label_positions:
            batch["label_positions"] = label_positions(batch["labels"])
        if weight is not None:
            batch["token_weight"] = weight
        if reference is not None:  # computed before the first step (dpo.precompute_reference)
            batch["reference"] = torch.tensor(reference)
        if part == "train" and (desirable := desirable_of(mb)) is not None:  # KTO's labels
            batch["desirable"] = torch.tensor(desirable)
        batches.append(to_device(batch, strategy.env.device))
    return batches


def normaliser(examples: list, cfg: Config) -> int:
    """What the global batch's summed loss is divided by: its labelled tokens (sft), or its
    pairs (a preference objective: the mean pair loss, `distft.model.preference`; KTO's answers)."""
    return count_label_tokens(examples) if cfg.train.objective == "sft" else len(examples)


def orpo_token_weight(examples: list, cfg: Config) -> torch.Tensor | None:
    """ORPO: pairs / chosen answer tokens of the global batch, which turns each pair's summed NLL
    into its share of the global batch's mean token NLL once the step divides by the pairs."""
    if cfg.train.objective != "orpo":
        return None
    # (1,): a pipeline cuts it per micro-batch
    return torch.tensor([len(examples) / count_label_tokens([p.chosen for p in examples])])


def expected(run: Run) -> tuple[Callable, Callable]:
    """The planner's formulas on a step's examples as this rank batches them (`distft.plan.expected`):
    the bytes the step moves, and the activations its first micro-batch keeps."""

    def step_bytes(examples: list[Example]) -> tuple | None:
        if run.architecture is None:  # an architecture the planner does not model
            return None
        batches = rank_batches(examples, run.strategy, run.cfg, run.pad_id)
        kto = run.cfg.train.objective == "kto"
        kl_batches = rank_batches(examples, run.strategy, run.cfg, run.pad_id, part="kl") if kto else []
        return expected_step_bytes(run.cfg, run.strategy, run.model, run.architecture, batches, kl_batches)

    def saved(examples: list[Example]) -> int | None:
        if run.architecture is None:
            return None
        batch = rank_batches(examples, run.strategy, run.cfg, run.pad_id)[0]
        return expected_activations(run.cfg, run.strategy, run.model, run.architecture, batch)

    return step_bytes, saved


def to_device(batch: Batch, device: torch.device) -> Batch:
    """`batch` on `device`. On CUDA from pinned host memory, so the copy is asynchronous
    (`non_blocking`) and the host goes on queueing kernels instead of waiting for it."""
    pin = device.type == "cuda"
    return {k: (v.pin_memory() if pin else v).to(device, non_blocking=pin) for k, v in batch.items()}


def train_step(
    run: Run, examples: list[Example], step: int, after_backward: Callable[[nn.Module, int], None]
) -> tuple[float, float, bool]:
    """Forward and backward over this rank's micro-batches, clip, and step the optimizer.

    Returns (loss, gradient norm, whether the weights were updated); `step` is 1-based. A
    non-finite loss or norm stops the run (`train.on_nonfinite=stop`) or skips the update (`skip`).
    """
    cfg, strategy, model = run.cfg, run.strategy, run.model
    n_tokens = normaliser(examples, cfg)
    batches = rank_batches(examples, strategy, cfg, run.pad_id)
    what = f"{strategy.spec.collectives} in step {step}'s forward/backward"
    with run.autocast, run.collective(what), compile_errors_unwrapped():
        with_kl(run, examples, batches)  # KTO's: scored before the forward that uses it
        loss_sum = strategy.forward_backward(model, batches, n_tokens)
    after_backward(model, step)
    with run.collective(f"the all-reduces of the gradient norm and the loss in step {step}"):
        norm = strategy.clip_grad_norm_(model, cfg.optim.grad_clip)
        total = strategy.reduce_loss(loss_sum)
        stats = step_statistics(run, batches)  # a preference objective's rewards, margins; an MoE's routing
        # The step's one host sync: loss and norm come back together (the branch below needs both).
        total, grad_norm, *stats = torch.cat(
            [torch.stack([total.double(), norm.double()]), stats.double()]
        ).tolist()
    loss = total / n_tokens
    run.statistics = step_means(run, stats, n_tokens)
    # Both are global (reduced over ranks), so every rank takes the same branch here.
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if finite:
        run.optimizer.step()
    elif cfg.train.on_nonfinite == "stop":
        raise NonFiniteError(
            f"Step {step}: the loss is {loss:.4g} and the gradient norm {grad_norm:.4g}; training "
            "diverged, and stopped before the optimizer step, so no weight took the update. "
            f"{resume_hint(run.out)} Resume with train.on_nonfinite=skip to skip such steps, or lower "
            "optim.lr in a new run."
        )
    run.step_lr = run.scheduler.get_last_lr()[0]  # the rate this update used, for its record
    run.scheduler.step()  # a skipped step still counts: the LR stays a function of the step
    run.optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm, finite


def step_statistics(run: Run, batches: list[Batch], routers: bool = True) -> torch.Tensor:
    """The sums behind the step's statistics, reduced over ranks as the loss is, in one all-reduce:
    a preference objective's `distft.model.preference.STATS` (KTO's KL estimate after them, the
    same on every rank) and an MoE's router statistics (`distft.model.router`; `routers`: False
    in a validation, which runs none with gradients). Empty for a dense model's sft."""
    lm, device = unwrap(run.model), run.env.device
    parts = [lm.preference.take_stats(device)] if lm.preference is not None else []
    if lm.router is not None and routers:
        parts.append(lm.router.take_stats(device).float())
    sums = run.strategy.reduce_loss(torch.cat(parts)) if parts else torch.zeros(0, device=device)
    return torch.cat([sums, batches[0]["kl"].reshape(1)]) if "kl" in batches[0] else sums


def step_means(run: Run, stats: list[float], n: int, prefix: str = "", routers: bool = True) -> dict:
    """The step's statistics (`step_statistics`) as metrics.jsonl records them."""
    lm = unwrap(run.model)
    means: dict = {}
    if lm.preference is not None:
        means = lm.preference.means(stats[: len(STATS)], n)
        stats = stats[len(STATS) :]
    if lm.router is not None and routers:
        means |= lm.router.means(stats[: lm.router.size])
        stats = stats[lm.router.size :]
    if stats:  # KTO's KL estimate
        means["kl"] = stats[0]
    return {prefix + name: value for name, value in means.items()}


@torch.no_grad()
def with_kl(run: Run, examples: list, batches: list[Batch]) -> None:
    """KTO: give each micro-batch the global batch's z0 (`distft.model.preference`). Each rank
    scores its slice of the mismatched answers against the reference, the sum is reduced over
    the ranks as a loss is, and every rank divides by the global batch's answers."""
    if run.cfg.train.objective != "kto":
        return
    lm = unwrap(run.model)
    lm.scoring = "ratio"
    try:
        kl_batches = rank_batches(examples, run.strategy, run.cfg, run.pad_id, part="kl")
        total = run.strategy.scores(run.model, kl_batches).sum()
    finally:
        lm.scoring = False
    kl = (run.strategy.reduce_loss(total) / len(examples)).clamp(min=0).reshape(1)  # (1,): as token_weight
    for batch in batches:
        batch["kl"] = kl


def between_batches(run: Run, phase: str, batch: int) -> None:
    """Before batch `batch` of `phase`, a phase without steps (`TrainHooks.before_batch`): once any
    rank has a signal, every rank raises `signals.Interrupted` here, at the same batch."""
    run.hooks.before_batch(phase, batch, run.env.rank)
    if signum := agreed_signal(run.env):
        raise signals.Interrupted(signum)


def eval_batch_count(run: Run) -> int:
    """Global batches of the validation split an evaluation reads: `train.eval_batches`, as many as
    it holds (a split smaller than one: all of it, one short batch)."""
    return max(min(run.cfg.train.eval_batches, len(run.val_set) // run.cfg.train.global_batch_size), 1)


@torch.no_grad()
def evaluate(run: Run) -> float:
    """Mean token loss over the first `train.eval_batches` global batches of the validation split,
    the same float on every rank (early stopping decides on it, `distft.train.early_stopping`)."""
    model, strategy, examples = run.model, run.strategy, run.val_set
    model.eval()
    gb = run.cfg.train.global_batch_size
    loss_sum, n_tokens = torch.zeros((), device=run.env.device), 0
    # Compiled blocks hold training graphs; without grad every guard fails. A few batches run
    # eagerly rather than pay a second compile of every block (tens of seconds on a GPU).
    try:
        with torch.compiler.set_stance("eager_on_recompile"):
            for b in range(eval_batch_count(run)):
                between_batches(run, "validation", b)
                batch = [examples[i] for i in range(b * gb, min((b + 1) * gb, len(examples)))]
                n_tokens += normaliser(batch, run.cfg)
                batches = rank_batches(batch, strategy, run.cfg, run.pad_id)
                with run.autocast:
                    with_kl(run, batch, batches)
                    loss_sum += strategy.forward_only(model, batches)
    finally:  # a stop too: its checkpoint is taken in the training layout
        strategy.release_gathered(model)
        model.train()
    stats = step_statistics(run, batches, routers=False)
    total = strategy.reduce_loss(loss_sum).double()  # float32 -> float64 is exact: the value is unchanged
    # `reduce_loss` gives every rank the sum, by an all-reduce or, where each rank computed the whole
    # loss (tensor parallel), by computing the same thing: rank 0's value makes it the same bits.
    if run.env.distributed and run.env.world_size > 1:
        dist.broadcast(total, src=0)
    run.statistics = step_means(run, stats.tolist(), n_tokens, prefix="eval_", routers=False)
    return total.item() / n_tokens
