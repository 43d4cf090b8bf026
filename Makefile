# The two commands the README opens with: `make demo` and `make test`. Both build .venv from nothing.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test lint format clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The exact pin matters: here pip takes the CPU build from local disk; on a CUDA machine, the CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: install  ## train the tiny Qwen3 on the bundled meetings (CPU), then summarise a held-out meeting
	$(VENV)/bin/distft train --out runs/demo --overwrite  # a second `make demo` replaces the first
	$(VENV)/bin/distft infer --run runs/demo

test: install  ## lint, then the whole suite (CPU, gloo; GPU tests skip without CUDA)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(PY) -m pytest -q -n 2 --dist loadfile  # two workers: most of a test is single-threaded start-up

format: install
	$(VENV)/bin/ruff check --fix src tests
	$(VENV)/bin/ruff format src tests

clean:
	rm -rf $(VENV) runs build src/*.egg-info
