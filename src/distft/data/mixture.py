"""Several datasets mixed by weight (`data.sources`): which rows of each train, in what order.

Each `[[data.sources]]` table names a source (a local file, a hub id or `sample`), a `weight`
(default 1) and a `format` (default `data.format`; `auto` detects per row, so each source may have
its own). Every source is read and split on its own, exactly as `data.source` would be (its hub
validation split, or `data.validation_fraction` held out with the run's seed). Then:

- the training mixture has as many rows as the sources' training splits together (T); source i
  contributes k_i = round(w_i / sum(w) x T) of them: every one of its n_i rows floor(k_i / n_i)
  times over, then the first k_i mod n_i rows of a seeded permutation of its rows (so a weight
  above its share repeats rows, one below it samples them, without replacement);
- the picks of all sources are shuffled together by a seeded permutation;
- validation is every source's validation split, unweighted, one after another in source order.

The random draws come from one generator seeded with `train.seed` (one permutation per source in
order, then the shuffle), so the mixture is fixed by the seed, the sources' rows and the weights,
and the token cache (`distft.data.cache`, whose key covers each source and `data.sources`) and the
in-memory path (`distft.data.rows.load_rows`) train on the same rows in the same order.
`data.max_rows` then keeps the mixture's first rows. A row's origin stays its own `file:line`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from distft.config import DataConfig


def source_configs(cfg: DataConfig) -> list[DataConfig]:
    """One data config per `data.sources` entry: its source and format, everything else shared."""
    return [
        replace(cfg, source=e["source"], format=e.get("format", cfg.format), sources=[], max_rows=0)
        for e in cfg.sources
    ]


def source_weights(cfg: DataConfig) -> list[float]:
    return [float(e.get("weight", 1.0)) for e in cfg.sources]


def data_name(cfg: DataConfig) -> str:
    """What the run's rows are called in the header and in errors: the source, or the mixture."""
    if not cfg.sources:
        return cfg.source
    parts = [f"{e['source']} (weight {w:g})" for e, w in zip(cfg.sources, source_weights(cfg), strict=True)]
    return "mixture of " + ", ".join(parts)


def mixture_shares(sizes: Sequence[int], weights: Sequence[float]) -> list[int]:
    """How many training rows each source contributes: k_i = round(w_i / sum(w) x T), 0 for an empty source."""
    total, weight_sum = sum(sizes), sum(weights)
    return [round(w / weight_sum * total) if n else 0 for n, w in zip(sizes, weights, strict=True)]


def starved_sources(cfg: DataConfig, sizes: Sequence[int]) -> str | None:
    """The warning for sources with training rows whose share rounds to none of the mixture, or None.
    Said where the mixture is composed (the token cache's build, or rows read in memory)."""
    weights = source_weights(cfg)
    shares = mixture_shares(sizes, weights)
    starved = [
        f"{e['source']} (weight {w:g}, {n:,} rows)"
        for e, w, n, k in zip(cfg.sources, weights, sizes, shares, strict=True)
        if n and not k
    ]
    if not starved:
        return None
    return (
        f"warning: data.sources: {', '.join(starved)} contributes no row to the {sum(shares):,} training rows "
        f"of the mixture: its share, weight / {sum(weights):g} of {sum(sizes):,} rows, rounds to 0. "
        "Raise its weight, or leave it out."
    )


def mixture_picks(sizes: Sequence[int], weights: Sequence[float], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The training mixture as (source, position) pairs, in training order (the rule above)."""
    generator = torch.Generator().manual_seed(seed)
    sources, positions = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for i, (n, k) in enumerate(zip(sizes, mixture_shares(sizes, weights), strict=True)):
        sample = torch.randperm(n, generator=generator).numpy()  # drawn for every source: stable
        if k == 0:
            continue
        whole, rest = divmod(k, n)
        picked = np.concatenate([np.tile(np.arange(n, dtype=np.int64), whole), sample[:rest]])
        sources.append(np.full(len(picked), i, dtype=np.int64))
        positions.append(picked)
    source, position = np.concatenate(sources), np.concatenate(positions)
    order = torch.randperm(len(source), generator=generator).numpy()
    return source[order], position[order]


def warn_starved(cfg: DataConfig, sizes: Sequence[int]) -> None:
    """Say `starved_sources`' warning, if any, on stderr."""
    if line := starved_sources(cfg, sizes):
        print(line, file=sys.stderr, flush=True)


def mix_splits(parts: list[dict[str, np.ndarray]], cfg: DataConfig, seed: int) -> dict[str, np.ndarray]:
    """Each source's split arrays (of anything: example numbers) mixed: train by `mixture_picks`,
    validation concatenated. A source left out by rounding is warned of."""
    sizes = [len(p["train"]) for p in parts]
    warn_starved(cfg, sizes)
    source, position = mixture_picks(sizes, source_weights(cfg), seed)
    starts = np.cumsum([0, *sizes])
    train = np.concatenate([p["train"] for p in parts])[starts[source] + position]
    return {"train": train, "validation": np.concatenate([p["validation"] for p in parts])}
