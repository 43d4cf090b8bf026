"""The longest sequence each layout can train on the given GPUs: the memory model, searched.

Activations grow with the sequence (linearly, and with eager attention quadratically), weights do
not: for each strategy, at its best factorisation of the GPUs, `longest_sequence` bisects over
sequence lengths in steps of 1,024 tokens for the longest at which the estimate still fits, up to
the positions the model's rotary embeddings reach (with the request's RoPE scaling;
`distft.model.positions`). It answers at the checkpointing level asked, and at `offload`, the
level that keeps the least on the GPU. A summary's loss positions stay as asked; a request whose
every position carries the loss (`--label-tokens` >= `--seq-len`, text rows) keeps it so at every
length, since the loss head then grows with the sequence too.
"""

from __future__ import annotations

from dataclasses import replace

from distft.model.positions import max_positions, scale_rope
from distft.plan.estimate import Request, candidate_parallelisms, estimate

STEP = 1024  # tokens: the resolution of the search
UNBOUNDED = 1 << 21  # a model whose config says nothing of its positions: 2M tokens at most


def positions_limit(req: Request) -> int:
    """The longest sequence the model's rotary embeddings reach, with the request's scaling."""
    t = req.training
    rotary = scale_rope(dict(req.model.rotary), t.rope_scaling, t.rope_factor, req.model.name)
    return max_positions(rotary) or UNBOUNDED


def fits_at(req: Request, strategy: str, seq: int, level: str) -> bool:
    """Whether some layout of `strategy` fits `seq` tokens per sequence at checkpointing `level`."""
    t = req.training
    labels = seq if t.label_tokens >= t.seq_len else min(t.label_tokens, seq)
    at = replace(req, training=replace(t, seq_len=seq, label_tokens=labels, activation_checkpointing=level))
    return any(
        e.applicable and e.fits
        for e in (estimate(at, lay, strategy) for lay in candidate_parallelisms(at, strategy))
    )


def longest_sequence(req: Request, strategy: str, level: str) -> int:
    """The longest multiple of `STEP` tokens (up to the model's positions) at which `strategy`
    fits with checkpointing `level`; 0 if not even `STEP`."""
    limit = positions_limit(req)
    if fits_at(req, strategy, limit, level):
        return limit
    low, high = 0, limit // STEP  # fits at low * STEP (0: nothing), not at high * STEP
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits_at(req, strategy, mid * STEP, level) else (low, mid)
    return low * STEP


def longest_sequences(req: Request, strategies: list[str]) -> dict[str, dict[str, int]]:
    """Per strategy: the longest sequence at the level asked and, when it differs, at offload."""
    levels = dict.fromkeys((req.training.activation_checkpointing, "offload"))
    return {s: {level: longest_sequence(req, s, level) for level in levels} for s in strategies}
