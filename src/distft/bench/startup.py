"""`distft bench --startup`: time from the command to step 1 against the dataset's size.

For each size, a JSONL file of short synthetic prompt/completion rows and one `distft train` per
mode, all on the same strategy and process count:

- `off`: `data.cache=false`, what every run did before the token cache: the CLI tokenises every
  row to check it, then every rank tokenises every row again, in memory;
- `cold`: a fresh cache directory: the CLI tokenises once into the cache, the ranks open it;
- `warm`: the same command again: nothing is tokenised, every rank opens the cache.

Start-up is `startup_s` of the first metrics record (command start to step 1, `distft.train.
metrics`); the ranks' data set-up is the longest `token_cache.seconds` in `ranks.json`. The bound:
a warm start-up at any size within `bound_s` of the smallest size's, i.e. start-up does not grow
with the dataset once it is tokenised. It is checked here, on the measured figures, never in a test.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from distft.bench.harness import environment, run_train
from distft.io.files import atomic_write_text

MODES = ("off", "cold", "warm")
STRATEGY = "ddp"  # its ranks all open the one store; any multi-process strategy would do
RANK_DATA_BOUND_S = 1.0  # a rank opening a warm cache, at any size (it maps files; measured: ~1 ms)


@dataclass
class StartupSettings:
    sizes: list[int] = field(default_factory=lambda: [1_000, 10_000, 100_000])
    nproc: int = 2
    model: str = "micro"
    repeats: int = 1  # runs per size and mode (medians are compared with the bound)
    bound_s: float = 5.0  # a warm start-up may exceed the smallest size's by this much
    overrides: list[str] = field(default_factory=list)


def write_synthetic_rows(path: Path, n: int) -> Path:
    """`n` short prompt/completion rows, each distinct (a few tokens each): fast to write, and
    quick enough to tokenise that a test can afford 100k of them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            f.write(
                json.dumps({"prompt": f"What is {i} plus {i % 97}?", "completion": f"{i + i % 97}."}) + "\n"
            )
    return path


def train_args(settings: StartupSettings, data: Path, cache: Path, out: Path, mode: str) -> list[str]:
    return [
        "train", "--strategy", STRATEGY, "--nproc", str(settings.nproc), "--model", settings.model,
        "--data", str(data), "--max-steps", "1", "--out", str(out), "--overwrite",
        "train.global_batch_size=4", "train.micro_batch_size=1", "train.eval_batches=1",
        "data.max_length=128", f"data.cache={'false' if mode == 'off' else 'true'}", f"data.cache_dir={cache}",
        *settings.overrides,
    ]  # fmt: skip


def run_once(settings: StartupSettings, data: Path, cache: Path, out: Path, mode: str) -> dict:
    """One `distft train` to step 1: its start-up, its wall time, and each rank's data set-up."""
    wall = run_train(train_args(settings, data, cache, out, mode), out)
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    ranks = json.loads((out / "ranks.json").read_text())
    caches = [r["token_cache"] for r in ranks]
    return {
        "startup_s": first["startup_s"],
        "wall_s": wall,
        "rank_data_s": max(c["seconds"] for c in caches),
        "rank_states": sorted({c["state"] for c in caches}),
        "examples_read": max(c["examples_read"] for c in caches),
        "load_1min": os.getloadavg()[0],  # runnable processes on the machine: others' work shows here
    }


def run_size(settings: StartupSettings, n: int, out: Path) -> dict:
    """One size: `repeats` runs of each mode, interleaved (off, cold, warm, off, ...) so a slow spell
    of a shared machine falls on every mode; a cold run starts from an empty cache directory."""
    data = write_synthetic_rows(out / f"rows-{n}.jsonl", n)
    cache = out / f"cache-{n}"
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(settings.repeats):
        for mode in MODES:
            if mode == "cold":
                shutil.rmtree(cache, ignore_errors=True)
            runs[mode].append(run_once(settings, data, cache, out / f"run-{n}-{mode}", mode))
            if mode == "cold":  # how long the first tokenisation itself took
                store = next(p for p in cache.iterdir() if not p.name.startswith("."))
                runs[mode][-1]["build_s"] = json.loads((store / "meta.json").read_text())["build_s"]
    row: dict = {"rows": n}
    for mode, measured in runs.items():
        startup = [r["startup_s"] for r in measured]
        row[mode] = {
            "startup_s": statistics.median(startup), "startup_min_s": min(startup), "startup_max_s": max(startup),
            "runs": measured,
        }  # fmt: skip
    return row


def run_startup_bench(settings: StartupSettings, out: Path) -> dict:
    """Every size and mode, measured; the bound checked on the warm start-ups."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in settings.sizes:
        rows.append(run_size(settings, n, out))
        print(f"{n:>9,} rows: " + ", ".join(f"{m} {rows[-1][m]['startup_s']:.1f} s" for m in MODES))
    return {
        "settings": asdict(settings),
        "environment": environment(),
        "rows": rows,
        "bound": check_bound(rows, settings),
    }


def check_bound(rows: list[dict], settings: StartupSettings) -> dict:
    """With a warm cache, start-up at every size within `bound_s` of the smallest size's (medians),
    and every rank's data set-up (opening the cache) under `RANK_DATA_BOUND_S` in every run."""
    warm = [r["warm"] for r in rows]
    base = warm[0]["startup_s"]  # the smallest size (sizes are given in increasing order)
    worst = max(w["startup_s"] - base for w in warm)
    rank_data = max(run["rank_data_s"] for w in warm for run in w["runs"])
    return {
        "bound_s": settings.bound_s, "base_s": base, "worst_excess_s": worst,
        "rank_data_bound_s": RANK_DATA_BOUND_S, "rank_data_max_s": rank_data,
        "holds": worst <= settings.bound_s and rank_data <= RANK_DATA_BOUND_S,
    }  # fmt: skip


def _cell(row: dict, mode: str) -> str:
    m = row[mode]
    spread = f" [{m['startup_min_s']:.1f}-{m['startup_max_s']:.1f}]" if len(m["runs"]) > 1 else ""
    return f"{m['startup_s']:.1f}{spread}"


def write_startup_report(summary: dict, out: Path) -> Path:
    """`startup.md`: one row per size, start-up per mode, and the bound."""
    s, env, bound = summary["settings"], summary["environment"], summary["bound"]
    lines = [
        "# Start-up vs dataset size",
        "",
        f"`distft train --strategy {STRATEGY} --nproc {s['nproc']} --model {s['model']} --max-steps 1`, "
        f"short synthetic prompt/completion rows, data.max_length=128; {env['cpu_count']} CPU cores, {env['device']}, "
        f"torch {env['torch']}. Seconds from the command to step 1 (`startup_s`), median [min-max] of "
        f"{s['repeats']} run(s) per mode, interleaved; load: the machine's 1-minute load average after the runs.",
        "",
        "| rows | cache off (before) | cold cache | first tokenisation | warm cache | ranks' data set-up, warm | examples a rank read | load |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for r in summary["rows"]:
        runs = [run for m in MODES for run in r[m]["runs"]]
        first = statistics.median(run["build_s"] for run in r["cold"]["runs"])
        warm = r["warm"]["runs"]
        rank_data = max(w["rank_data_s"] for w in warm) * 1000
        read = max(w["examples_read"] for w in warm)
        load = statistics.median(run["load_1min"] for run in runs)
        lines.append(
            f"| {r['rows']:,} | {_cell(r, 'off')} | {_cell(r, 'cold')} | {first:.2f} | {_cell(r, 'warm')} | "
            f"{rank_data:.0f} ms | {read} | {load:.1f} |"
        )
    verdict = "holds" if bound["holds"] else "FAILS"
    lines += [
        "",
        f"Bound: with a warm cache, start-up within {bound['bound_s']:.1f} s of the smallest size's "
        f"({bound['base_s']:.1f} s; worst excess {bound['worst_excess_s']:+.1f} s), and every rank's data set-up "
        f"under {bound['rank_data_bound_s']:.1f} s (longest {bound['rank_data_max_s'] * 1000:.0f} ms): **{verdict}**.",
    ]
    path = out / "startup.md"
    atomic_write_text(path, "\n".join(lines) + "\n")
    atomic_write_text(out / "startup.json", json.dumps(summary, indent=1))
    return path
