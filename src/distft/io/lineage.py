"""Where a model came from: `lineage.json`; above all, whether it started as a random preset.

A preset (`tiny`, `micro`, ...) is an architecture with random weights: whatever it writes after
training it learned from the run's data alone, and the user must be told so before judging its
output. A run on a preset writes `DIR/lineage.json`, and a full finetune also writes it beside its
weights in `DIR/model/`; a run whose `--model` is such a directory (a LoRA stage on a stage-1 model,
`make demo`) extends the chain. So `distft infer`/`eval` and the training header can say, for any
model in the chain, "random `tiny`, then N steps of full finetuning on X, then M steps of LoRA".
A run on a pretrained base (a hub id, a directory without the file) records where it came from
instead: the name, the revision asked for, the commit loaded and whether its own code ran
(`model.build.pretrained_origin`). Only a chain that starts at a preset is "random" (`is_random`),
and only that gets the notice.

    {"origin": {"preset": "tiny", "seed": 0, ...},          # the recipe (`model.build.base_recipe`)
     "stages": [{"method": "full", "steps": 400, "data": "sample", "run": "/abs/runs/demo-base"}]}
    {"origin": {"model": "Qwen/Qwen3-4B", "revision": null, "commit": "1cfa9a7...",
                "trust_remote_code": false}, "stages": [...]}

A run that goes on training an adapter of the same base (`lora.init_adapter`: DPO from an SFT
adapter) takes that adapter's chain and marks its own stage `"continues": true`; `base_stages`
tells the base's stages from the adapter's.
"""

from __future__ import annotations

import json
from pathlib import Path

from distft.config import Config
from distft.data import data_name
from distft.data.sample import SAMPLES, is_sample
from distft.io.files import atomic_write_text
from distft.model import PRESETS, is_preset
from distft.model.families import FAMILIES
from distft.text import plural

LINEAGE_FILE = "lineage.json"
METHOD_NAMES = {"full": "full finetuning", "lora": "LoRA", "qlora": "QLoRA"}


def read_lineage(path: str | Path) -> dict | None:
    """The lineage written in directory `path` (a run, a full model, an export), or None."""
    file = Path(path) / LINEAGE_FILE
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else None


def is_random(lineage: dict | None) -> bool:
    """Whether the chain starts at a random preset (a model that knows only its runs' data)."""
    return lineage is not None and "preset" in lineage["origin"]


def run_lineage(cfg: Config, recipe: dict | None, pretrained: dict | None = None) -> dict:
    """The lineage of the model a run with `cfg` produces: its base's (a preset: `recipe`; a
    directory: its lineage.json; else `pretrained`, where it came from), or the chain of the run
    whose adapter it starts from (`lora.init_adapter`), plus this run as the last stage."""
    if is_preset(cfg.model.name) and not Path(cfg.model.name).is_dir():
        base = {"origin": recipe, "stages": []}
    else:
        base = read_lineage(cfg.model.name) or {
            "origin": pretrained or {"model": cfg.model.name},
            "stages": [],
        }
    stage = run_stage(cfg) | {"run": str(Path(cfg.output.dir).resolve())}
    # An adapter trained on this very base: its chain goes on, this run's stage marked as its
    # continuation. One trained elsewhere (a foreign PEFT adapter) starts this run's chain anew.
    start = _adapter_lineage(cfg.lora.init_adapter) if cfg.lora.init_adapter else None
    if start is not None and {"origin": start["origin"], "stages": base_stages(start)} == json.loads(
        json.dumps(base)  # as the adapter's run wrote it
    ):
        return {"origin": start["origin"], "stages": [*start["stages"], {**stage, "continues": True}]}
    return {"origin": base["origin"], "stages": [*base["stages"], stage]}


def run_stage(cfg: Config) -> dict:
    """A run's stage in a lineage, but where it ran: a preference run's names its objective (an
    SFT run's, older lineages' too, say none)."""
    objective = {"objective": cfg.train.objective} if cfg.train.objective != "sft" else {}
    return {
        "method": cfg.train.method,
        **objective,
        "steps": cfg.train.max_steps,
        "data": data_name(cfg.data),
    }


def base_stages(lineage: dict) -> list[dict]:
    """The stages that trained the base of the chain's last run: all but that run's own and the
    adapter stages it went on from (`continues`, a run from `lora.init_adapter`)."""
    stages = list(lineage["stages"])
    while stages and stages.pop().get("continues"):
        pass
    return stages


def _adapter_lineage(path: str) -> dict | None:
    """The lineage of the run that trained the adapter at `path` (its run directory, or the
    `adapter/` inside it), or None where it has none."""
    directory = Path(path)
    return read_lineage(directory) or (
        read_lineage(directory.parent) if directory.name == "adapter" else None
    )


def write_lineage(path: Path, lineage: dict | None) -> None:
    if lineage is not None:
        atomic_write_text(Path(path) / LINEAGE_FILE, json.dumps(lineage, indent=1) + "\n")


def _data_name(source: str) -> str:
    return f"{SAMPLES[source].title} (--data {source})" if is_sample(source) else f"`{source}`"


def describe(lineage: dict, this_run: str | None = None) -> str:
    """One paragraph a user reads before judging the model's output: what the model is."""
    origin = lineage["origin"]
    stages = lineage["stages"]
    sources = sorted({s["data"] for s in stages})
    data = " and ".join(_data_name(s) for s in sources) if sources else "nothing yet"
    steps = ", then ".join(stage_text(s, this_run) for s in stages)
    preset = PRESETS.get(origin["preset"])
    title = FAMILIES[preset.family].title if preset else "Qwen3"
    size = "a small " if preset and preset.hidden_size < 1024 else "a "
    return (
        f"note: this is not a real language model. It is distft's `{origin['preset']}` preset, {size}"
        f"{title} architecture with random initial weights (seed {origin['seed']}), trained only on {data}"
        + (f": {steps}" if steps else "")
        + f". Its output shows that the pipeline works, not what a pretrained {title} writes; for real "
        "results train on a pretrained model (--model Qwen/Qwen3-0.6B, or a local directory)."
    )


def stage_text(stage: dict, this_run: str | None = None) -> str:
    """ "400 steps of full finetuning (runs/demo-base)", "30 steps of DPO (LoRA, this run)"."""
    method = METHOD_NAMES.get(stage["method"], stage["method"])
    objective = stage.get("objective")
    said = [method] if objective else []  # a preference objective is what the steps did, on `method`
    run = stage.get("run")
    if run:
        said.append("this run" if this_run and run == str(Path(this_run).resolve()) else _short(run))
    text = f"{plural(stage['steps'], 'step')} of {objective.upper() if objective else method}"
    return f"{text} ({', '.join(said)})" if said else text


def origin_text(lineage: dict) -> str:
    return f"`{lineage['origin']['preset']}` preset, random weights"


def _short(run: str) -> str:
    """A run directory as the user typed it, relative to here when it is below here."""
    try:
        return str(Path(run).relative_to(Path.cwd()))
    except ValueError:
        return run
