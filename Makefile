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

.PHONY: gpu-wheels
## Wheels a lent GPU machine lacks for `import gridshard` and the CLI (it has torch, numpy, no
## registry): downloaded here for its Python, carried with `carry: ["gpu-wheels"]` (docs/gpu.md).
GPU_PYTHON ?= 3.12
GPU_WHEELS := pydantic pyyaml click tqdm
gpu-wheels:
	rm -rf gpu-wheels     # one version of each: two would stop the install there
	python3 -m pip download -q --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  --platform any -d gpu-wheels $(GPU_WHEELS)
