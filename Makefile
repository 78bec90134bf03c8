# One-command set-up: every target installs what it needs into .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q -r requirements.txt
	touch $@

.PHONY: install test test-all train
install: $(VENV)/.installed

## Run the whole test suite (what CI runs).
test: install
	$(PY) -m pytest -q

## Everything, the wide matrices too (tests marked `wide`; see docs/testing.md).
test-all: install
	$(PY) -m pytest -q -m "wide or not wide"

## The main job: train the default tiny model on 4 local CPU workers.
train: install
	$(VENV)/bin/gridshard train --nproc 4 --run-dir runs/default --overwrite

.PHONY: mutants
## Mutation check: each curated bug in the core must turn a named test red (docs/testing.md).
mutants: install
	$(PY) scripts/mutants.py

.PHONY: plot bench-train
## Plot the default run (after `make train`).
plot: install
	$(VENV)/bin/gridshard plot runs/default

## Training-step overhead against a plain PyTorch loop (docs/training.md).
bench-train: install
	$(PY) benchmarks/bench_train_overhead.py
