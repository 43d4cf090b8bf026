# The two commands the README opens with: `make demo` and `make test`. Both build .venv from nothing.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# test-changed: the changes since the merge-base of HEAD and BASE, committed or not.
BASE   ?= main

.PHONY: install demo test test-changed lint format clean reports

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The exact pin matters: here pip takes the CPU build from local disk; on a CUDA machine, the CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]' -c constraints.txt  # the versions tested (constraints.txt)
	touch $(STAMP)

install: $(STAMP)

# The demo's model is the `tiny` preset: random initial weights, trained only on the bundled synthetic
# meetings. Stage 1 full-finetunes it (the random base learns the words), stage 2 trains a LoRA
# adapter on stage 1's model; eval scores the untrained model, stage 1 and stage 2 on 16 held-out
# meetings; infer summarises one of them. --overwrite: a second `make demo` replaces the first.
demo: install  ## two-stage training of the tiny Qwen3 on the bundled meetings (CPU), then eval and a held-out summary
	$(VENV)/bin/distft train --config configs/demo-base.toml --overwrite
	$(VENV)/bin/distft train --config configs/demo-lora.toml --overwrite
	$(VENV)/bin/distft eval --run runs/demo --rows 16
	$(VENV)/bin/distft infer --run runs/demo

test: install  ## lint, then the whole suite (CPU, gloo; GPU tests skip without CUDA)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder  # two workers, longest files first (tests/conftest.py)

# tests/changed.py picks the files from the import graph and the strategies a test names; it prints
# `tests` (everything) when unsure, nothing when nothing changed.
test-changed: install  ## lint, then only the test files the changes reach (a quick loop; CI runs `make test`)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	@files="$$($(PY) -m tests.changed --base $(BASE))" || exit 1; \
	if [ -z "$$files" ]; then echo "test-changed: no test file to run"; exit 0; fi; \
	set -x; $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder $$files

reports: install  ## regenerate the committed CPU reports under docs/reports/cpu/ (about an hour: docs/reports/README.md)
	DISTFT=$(VENV)/bin/distft docs/reports/regenerate-cpu.sh

format: install
	$(VENV)/bin/ruff check --fix src tests
	$(VENV)/bin/ruff format src tests

clean:
	rm -rf $(VENV) runs build src/*.egg-info
