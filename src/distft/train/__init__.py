"""Training: `train(cfg, hooks=None)` runs one finetune with the configured strategy.

- `setup`: everything built before the first step, in order, as a `Run`;
- `step`: one optimizer step and one evaluation;
- `measure`: what is measured around a step (collectives, saved activations, strategy figures);
- `metrics`: `metrics.jsonl` records and `ranks.json` figures; `progress`: what is printed;
- `hooks`: the callbacks a step makes (`TrainHooks`), no-ops unless the entry point installs some;
- `loop`: `train` itself, set-up -> loop -> export; `result`: what it returns.
"""

from distft.train.hooks import TrainHooks
from distft.train.loop import train
from distft.train.result import TrainResult

__all__ = ["TrainHooks", "TrainResult", "train"]
