from distft.model import PRESETS
from distft.model.families import FAMILIES

# Every family's micro preset (`micro` is Qwen3's): the models the planner is checked against;
# `DENSE_MICROS` without the mixture of experts (what QLoRA and the dense-only cases take).
MICROS = tuple(name for name in PRESETS if name.endswith("micro"))
DENSE_MICROS = tuple(name for name in MICROS if not FAMILIES[PRESETS[name].family].moe)
