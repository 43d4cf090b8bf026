"""Run outputs on disk: atomic files (`files`), training-state checkpoints (`checkpoint`), the
exported adapter or model (`export`), where a random preset's model came from (`lineage`), and the checks before a run writes anything (`preflight`).
Imports only `distft.errors`, `config`, `model` and `quant` below it."""
