from distft.model import PRESETS
from distft.model.families import FAMILIES

# Every dense family's micro preset (`micro` is Qwen3's): the models the planner is checked against.
# It does not count experts yet, and refuses an MoE in one line (tests/parallel/test_moe.py).
MICROS = tuple(name for name, p in PRESETS.items() if name.endswith("micro") and not FAMILIES[p.family].moe)
