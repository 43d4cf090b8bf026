"""Same hardware and software on every rank: each rank's device facts, and the comparison.

A job whose nodes differ trains, but not as planned: one node on another torch or transformers
release can compute a different model (or hang in a collective whose arguments changed), a smaller
or older GPU runs out of memory or sets the pace of every step, a rank without a GPU never meets
the others. `device_facts` is what one rank knows of itself; the health check gathers every
rank's (`distft.health.check`, in the all-gather it already makes), and `mixed_facts` names the
ranks that differ from the rest in one paragraph, or returns None when every rank agrees.
"""

from __future__ import annotations

import importlib.metadata
import platform
import socket
import sys
from collections import Counter

import torch

# Compared fields, in the message's order, with their label ("has torch 2.13.0").
COMPARED = {
    "device": "device",
    "memory_gib": "device memory (GiB)",
    "capability": "compute capability",
    "cuda": "CUDA runtime",
    "torch": "torch",
    "transformers": "transformers",
    "peft": "peft",
    "python": "Python",
    "distft": "distft",
}
MAX_HOSTS = 3  # hosts named per group of ranks


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def device_facts(device: torch.device) -> dict:
    """This rank's device (kind and model, memory and compute capability on CUDA), its software
    versions and its host name (reported, never compared)."""
    facts: dict = {"host": socket.gethostname(), "device": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts["device"] = f"cuda {props.name}"
        facts["memory_gib"] = round(props.total_memory / 1024**3, 1)
        facts["capability"] = f"{props.major}.{props.minor}"
        facts["cuda"] = torch.version.cuda
    return {
        **facts,
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "python": platform.python_version(),
        "distft": sys.modules["distft"].__version__,  # the package root, imported before any module
    }


def rank_ranges(ranks: list[int]) -> str:
    """`[0, 1, 2, 5]` -> "ranks 0-2, 5"; one rank: "rank 3"."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return "ranks " + ", ".join(
        f"{a}" if a == b else f"{a}-{b}" if b > a + 1 else f"{a}, {b}" for a, b in spans
    )


def _hosts(facts: list[dict], ranks: list[int]) -> str:
    hosts = list(dict.fromkeys(str(facts[r].get("host", "?")) for r in ranks))
    named = ", ".join(hosts[:MAX_HOSTS]) + (
        f" and {len(hosts) - MAX_HOSTS} more" if len(hosts) > MAX_HOSTS else ""
    )
    return f"host{'s' if len(hosts) > 1 else ''} {named}"


def differences(facts: list[dict]) -> list[str]:
    """One clause per compared field on which the ranks (`facts[r]` is rank r's) disagree: the odd
    ranks first, with their hosts, then the majority ("rank 3 (host b) has torch 2.12.0, ranks 0-2
    torch 2.13.0"). The majority is the most common value; a tie goes to rank 0's."""
    clauses = []
    for field, label in COMPARED.items():
        values = [str(f.get(field, "none")) for f in facts]
        if len(set(values)) < 2:
            continue
        counts = Counter(values)
        majority = max(counts, key=lambda v: (counts[v], v == values[0]))
        groups: dict[str, list[int]] = {}
        for rank, value in enumerate(values):
            groups.setdefault(value, []).append(rank)
        odd = [
            f"{rank_ranges(ranks)} ({_hosts(facts, ranks)}) {'has' if len(ranks) == 1 else 'have'} {label} {value}"
            for value, ranks in groups.items()
            if value != majority
        ]
        clauses.append(f"{'; '.join(odd)}, {rank_ranges(groups[majority])} {label} {majority}")
    return clauses


def mixed_facts(facts: list[dict]) -> str | None:
    """The paragraph naming the ranks whose device or software differs, or None."""
    clauses = differences(facts)
    if not clauses:
        return None
    return (
        f"The ranks do not run on the same hardware and software: {'; '.join(clauses)}. Mixed versions "
        "can compute a different model or hang in a collective, and a slower or smaller device sets the "
        "pace (or runs out of memory) for every rank."
    )


REMEDY = (
    "Install the same versions on every node and use one GPU model, or pass --allow-mixed "
    "(parallel.allow_mixed=true) to run anyway."
)
