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

# Three pytest workers on the 2-core test machine, one test file each at a time (so a file's shared
# runs are made once): the multi-process tests spend much of their time waiting (for a timeout to
# pass, a peer to be declared lost), and the other workers use it. Measured on that machine
# (2026-12-02, the same tree): 2 workers 918 s, 3 workers 803 s, 4 workers 782 s with the CPU then
# busy all the time; 3 keeps the load lower for the tests that kill and stall ranks.
TEST_WORKERS ?= 3

test: $(DEV_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# On a GPU machine (its own torch, no package index): install over that torch, run every CUDA
# path, write benchmarks/<date>_<gpu>_gpu-check.md. GPU_CHECK_FLAGS=--cpu runs the plan without CUDA.
gpu-check:
	$(PYTHON) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PYTHON) tools/gpucheck.py $(GPU_CHECK_FLAGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
