"""Run outputs on disk: atomic files (`files`), training-state checkpoints (`checkpoint`), the
exported adapter or model (`export`), and the checks before a run writes anything (`preflight`).
Imports only `distft.errors`, `config`, `model` and `quant` below it."""
