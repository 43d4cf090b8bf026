from distft.model import PRESETS

# Every family's micro preset (`micro` is Qwen3's): the models the planner is checked against.
MICROS = tuple(name for name in PRESETS if name.endswith("micro"))
