"""A pipeline's stage costs measured by a run, and the cut they give (`distft train --calibrate RUN`).

The balanced cut (`cost.balanced_cut`) is only as good as the costs it is given. The FLOPs model
(`cost.CostModel`) counts matmuls, which misjudges what is not one: on a small CPU model each
pass's fixed overhead and the elementwise work weigh as much as the matmuls (one micro run measured
a stage imbalance of 1.40 where the model says 1.82), and on a GPU a kernel's efficiency depends on
its shape (a thin lm_head matmul runs far below a layer's). A finished pipeline run knows better:
its `RUN/pipeline_timeline.json` (`distft.measure.pipeline`) records each stage's layers
(`layers_per_stage`, n_s) and its measured busy time in the last step (`stage_busy_s`, b_s: its F,
B and W passes summed over the micro-batches, averaged over the replicas that hold the stage).

**The fit** (`fit_costs`). Every decoder layer costs the same, t_layer; stage 0 adds t_first (the
embedding), the last stage t_last (final norm, lm_head and the loss):

    b_s = n_s t_layer + [s = 0] t_first + [s = S-1] t_last

by least squares over the S stages, in closed form: t_first and t_last each appear in one equation
only, so the optimum makes those two equations exact and fits t_layer to the other stages alone, a
line through the origin (t_layer = sum n_s b_s / sum n_s^2 over the middle stages); then t_first =
b_0 - n_0 t_layer and t_last = b_{S-1} - n_{S-1} t_layer. Three stages determine all three
exactly; more are fitted. **Two stages** give two equations for three unknowns: t_first is fixed at
0 (the embedding is a lookup, the cheapest piece, and the FLOPs model's 0 too), so its time counts
in stage 0's layers: t_layer = b_0 / n_0, and t_last = b_1 - n_1 t_layer. **Nonnegative**: a cost
that fits below zero (noise on a cost near nothing) is fixed at zero and its stage joins the fit of
t_layer, until none is negative.

Why the stage sums and not each pass (`ranks[*].events`): b_s already is the stage's passes summed,
i.e. the mean pass times the micro-batch count, and it is the figure `stage_imbalance` reports, so
the calibrated imbalance reads on the same scale. A median per pass would shrug off one slow pass,
but with the 2 to 8 micro-batches of a step it is hardly more robust than the mean; calibrate from
a run on a quiet machine instead. The times are of the measured run's step; the cut depends only on
their ratios, which hold for a run of the same model, method and rows (`data.max_length`, labelled
positions per row): a different batch or micro-batch count scales every stage about alike.

`calibrate(cfg, run_dir)` reads the timeline, fits it and cuts the new run's S = p x V stages,
which may differ from the measured run's; `Calibration.apply` sets `parallel.pp_split` to that
list and `Config.calibration` to what ranks.json's `pipeline` record keeps of it
(`calibrated_from`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from distft.config import Config
from distft.errors import ConfigError, DamagedFileError
from distft.model import model_config
from distft.parallel.pipeline.cost import CostModel, balanced_cut, even_cut, imbalance, stage_costs
from distft.parallel.pipeline.layout import cut_layers
from distft.parallel.registry import STRATEGIES

TIMELINE = "pipeline_timeline.json"  # what every pipeline run writes on its last step
_PIPELINED = [name for name, strategy in STRATEGIES.items() if hasattr(strategy, "pipeline_layout")]
PIPELINES = f"--strategy {', '.join(_PIPELINED[:-1])} or {_PIPELINED[-1]}"  # every registered pipeline


@dataclass(frozen=True)
class MeasuredCosts:
    """Seconds of one measured step: each decoder layer's, and what stage 0 and the last stage add."""

    layer_s: float  # t_layer
    first_s: float  # t_first: the embedding (0 when not separable: `first_fitted`)
    last_s: float  # t_last: final norm, lm_head and the loss
    num_layers: int  # decoder layers of the measured run's model
    first_fitted: bool = True  # False: 2 stages, t_first fixed at 0 (in stage 0's layers)

    def layer_costs(self) -> list[float]:
        return [self.layer_s] * self.num_layers

    def stage_costs(self, cut: Sequence[int]) -> list[float]:
        """Each stage's measured cost under `cut`, layers per stage."""
        return stage_costs(cut, self.layer_costs(), self.first_s, self.last_s)

    def balanced_cut(self, stages: int) -> tuple[int, ...]:
        """The cut of the layers into `stages` whose slowest stage costs least (`cost.balanced_cut`)."""
        return balanced_cut(self.layer_costs(), stages, self.first_s, self.last_s)


def fit_costs(layers_per_stage: Sequence[int], stage_busy_s: Sequence[float]) -> MeasuredCosts:
    """t_layer, t_first and t_last fitted to each stage's layers and busy time (the module
    docstring): least squares, closed form, nonnegative; t_first fixed at 0 for 2 stages."""
    n, b = list(layers_per_stage), list(stage_busy_s)
    last = len(n) - 1
    if last < 1 or len(b) != len(n):
        raise ValueError(f"need 2+ stages, one busy time each: {n}, {b}")
    fitted = {0: last > 1, last: True}  # the end stages whose extra is fitted, not fixed at 0
    while True:
        rows = [s for s in range(last + 1) if not fitted.get(s)]  # the equations t_layer is fitted to
        layer = math.fsum(n[s] * b[s] for s in rows) / math.fsum(n[s] ** 2 for s in rows)
        extra = {s: b[s] - n[s] * layer if fitted[s] else 0.0 for s in (0, last)}
        negative = [s for s in (0, last) if extra[s] < 0]
        if not negative:
            return MeasuredCosts(layer, extra[0], extra[last], sum(n), first_fitted=last > 1)
        for s in negative:  # fixed at 0: its stage's equation now fits t_layer too
            fitted[s] = False


def read_timeline(run_dir: str | Path) -> dict:
    """RUN_DIR/pipeline_timeline.json as a dict; a ConfigError saying how to get one if it is not there."""
    run = Path(run_dir)
    if not run.is_dir():
        raise ConfigError(f"--calibrate {run}: no such run directory.")
    path = run / TIMELINE
    if not path.is_file():
        raise ConfigError(
            f"--calibrate {run}: no {TIMELINE} there. Every pipeline run ({PIPELINES}) writes it on its last "
            "step: calibrate from a finished one."
        )
    try:
        timeline = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise DamagedFileError(f"{path} cannot be read as JSON ({err}): run the pipeline again.") from None
    if not isinstance(timeline, dict):
        raise DamagedFileError(f"{path} is not a pipeline timeline (a JSON object): run the pipeline again.")
    return timeline


def fit_timeline(timeline: dict, source: str = "the timeline") -> MeasuredCosts:
    """The costs fitted to a timeline's `layers_per_stage` and `stage_busy_s`, checked first: a
    ConfigError naming `source` for a file that is not a pipeline's, predates these fields, or
    holds a stage that computed nothing."""
    if "schedule" not in timeline or "ranks" not in timeline:
        raise ConfigError(
            f"{source} is not a pipeline timeline (no schedule, no ranks): calibrate from a pp run."
        )
    missing = [k for k in ("layers_per_stage", "stage_busy_s") if k not in timeline]
    if missing:
        raise ConfigError(
            f"{source} has no {' or '.join(missing)}: it comes from a distft from before pipeline runs recorded "
            "each stage's layers and busy time. Run the pipeline again (any pp run writes them)."
        )
    n, b = timeline["layers_per_stage"], timeline["stage_busy_s"]
    counts = isinstance(n, list) and all(isinstance(x, int) and x >= 1 for x in n)
    times = isinstance(b, list) and all(isinstance(x, int | float) and math.isfinite(x) for x in b)
    if not counts or not times or len(n) != len(b) or len(n) < 2:
        raise DamagedFileError(
            f"{source}: layers_per_stage {n!r:.60} and stage_busy_s {b!r:.60} are not one layer count (1+) and "
            "one time per stage of 2+ stages: the file is damaged. Run the pipeline again."
        )
    idle = [s for s, t in enumerate(b) if t <= 0]
    if idle:
        raise ConfigError(
            f"{source}: stage {idle[0]} recorded no passes (stage_busy_s {b[idle[0]]}): there is nothing to "
            "fit its cost to. Calibrate from a run whose every stage computed."
        )
    return fit_costs(n, b)


@dataclass(frozen=True)
class Calibration:
    """The new run's cut from a measured run's costs, beside the FLOPs model's and the even one."""

    source: str  # the measured run's directory
    schedule: str  # its schedule
    measured_cut: tuple[int, ...]  # its layers per stage
    costs: MeasuredCosts
    cut: tuple[int, ...]  # the new run's: balanced by `costs`
    modelled_cut: tuple[int, ...]  # the new run's balanced cut by the FLOPs model
    even: tuple[int, ...]

    def line(self) -> str:
        """What `distft train --calibrate` prints: the fit, the cut, and what the others would be."""
        c = self.costs
        alone = "" if c.first_fitted else " (2 stages: in stage 0's layers)"
        first = f"first +{c.first_s * 1e3:.1f} ms{alone}"
        return (
            f"calibrated from {self.source} ({self.schedule}, cut {list(self.measured_cut)}): "
            f"{c.layer_s * 1e3:.1f} ms per layer, last stage +{c.last_s * 1e3:.1f} ms, {first} -> "
            f"parallel.pp_split={list(self.cut)} (measured-cost imbalance {imbalance(c.stage_costs(self.cut)):.2f}; "
            f"the FLOPs model's balanced cut {list(self.modelled_cut)}, even {list(self.even)})"
        )

    def record(self) -> dict:
        """What ranks.json's `pipeline` record (`calibrated_from`) and the timeline keep of it."""
        c = self.costs
        return {
            "run": self.source,
            "schedule": self.schedule,
            "layers_per_stage": list(self.measured_cut),
            "layer_s": c.layer_s,
            "first_s": c.first_s,
            "last_s": c.last_s,
            "first_fitted": c.first_fitted,
            "pp_split": list(self.cut),
        }

    def apply(self, cfg: Config) -> None:
        """Cut `cfg`'s pipeline as calibrated: `parallel.pp_split` the list, `Config.calibration` the record."""
        cfg.parallel.pp_split = list(self.cut)
        cfg.calibration = self.record()


def calibrate(cfg: Config, run_dir: str | Path, overrides: Sequence[str] = ()) -> Calibration:
    """The cut of `cfg`'s pipeline balanced by the costs measured in `run_dir`'s timeline.

    Refused (ConfigError) when `cfg`'s strategy has no pipeline, `overrides` (the command line's
    `section.key=value`) also set parallel.pp_split, `run_dir` has no readable timeline, or its
    model has another number of decoder layers than `cfg`'s. A pp_split from a config file gives
    way, as every setting of a file does to a flag. `cfg` has passed `check_config`."""
    name = cfg.parallel.strategy
    strategy = STRATEGIES[name]
    if not hasattr(strategy, "pipeline_layout"):
        raise ConfigError(
            f"--calibrate {run_dir} re-cuts a pipeline's stages, but --strategy {name} has none: use {PIPELINES}."
        )
    both = [o for o in overrides if o.partition("=")[0].strip() == "parallel.pp_split"]
    if both:
        raise ConfigError(f"--calibrate {run_dir} and {both[-1]} both set parallel.pp_split: keep one.")
    timeline = read_timeline(run_dir)
    costs = fit_timeline(timeline, str(Path(run_dir) / TIMELINE))
    architecture = model_config(cfg.model.name, cfg.model.trust_remote_code, cfg.model.revision)
    layers = architecture.num_hidden_layers
    if costs.num_layers != layers:
        raise ConfigError(
            f"--calibrate {run_dir}: that run's model has {costs.num_layers} decoder layers, {cfg.model.name} "
            f"has {layers}. Calibrate from a run of the same model."
        )
    stages = strategy.pipeline_layout(cfg).num_stages
    return Calibration(
        source=str(run_dir),
        schedule=str(timeline["schedule"]),
        measured_cut=tuple(timeline["layers_per_stage"]),
        costs=costs,
        cut=cut_layers("balanced", costs, stages, cfg.model.name),  # ConfigError: more stages than layers
        modelled_cut=CostModel.for_run(cfg, architecture).balanced_cut(stages),
        even=even_cut(layers, stages),
    )
