# Two entry points for a fresh machine (see README): `make train` and `make test`.
# Both create .venv and install scaleloop into it, with the tested versions from constraints.txt
# (pyproject.toml gives torch a range; the constraints pin the release the suite runs on).
# `make train` installs only what training needs (-e .); `make test` adds the dev extras (pytest,
# the trackers, transformers, Ray Train). Each install has its own stamp in .venv, so `make test` after
# `make train` in the same clone still installs the dev extras (and `make train` after `make test`
# installs nothing more).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TRAIN_STAMP := $(VENV)/.installed-train
DEV_STAMP := $(VENV)/.installed-dev

# pip compiles what it installs, but not an editable project's own sources: compile them once, as
# pip would (and the tests' helper modules, which their workers import), or every process compiles
# them again where PYTHONDONTWRITEBYTECODE is set (about 0.2 s each, and the tests start hundreds).
# Python checks each file's time stamp against its compiled copy: an edited file is still read.
COMPILE_SRC := $(BIN)/python -m compileall -q src tests

.PHONY: train test clean gpu-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(TRAIN_STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install --quiet -c constraints.txt -e .
	$(COMPILE_SRC)
	touch $@

$(DEV_STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	$(COMPILE_SRC)
	touch $@ $(TRAIN_STAMP)

train: $(TRAIN_STAMP)
	$(BIN)/scaleloop train

# Two pytest workers, one test file each at a time (so a file's shared runs are made once): most
# of a multi-process test's time is spent waiting on its processes, and the other worker uses it.
TEST_WORKERS ?= 2

test: $(DEV_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# On a GPU machine (its own torch, no package index): install over that torch, run every CUDA
# path, write benchmarks/<date>_<gpu>_gpu-check.md. GPU_CHECK_FLAGS=--cpu runs the plan without CUDA.
gpu-check:
	$(PYTHON) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PYTHON) tools/gpucheck.py $(GPU_CHECK_FLAGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
