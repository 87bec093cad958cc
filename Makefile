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

# Where PYTHONDONTWRITEBYTECODE is set (as on the test machines), a module without a compiled copy is
# compiled again by every process that imports it, and the tests start hundreds. So everything is
# compiled once at install: pip's own compiling is on one core (about 50 CPU-seconds for the dev
# extras), so pip installs without it and compileall does it on every core. Left out: the installed
# packages' own test suites (nothing imports them) and one torch file written in Python 3.12's
# syntax (pip skips it too). The project's sources and the tests' helper modules (which their
# workers import) are compiled the same way; an edited file is still read (Python compares time stamps).
COMPILE := $(BIN)/python -m compileall -q -j 0
COMPILE_ALL := $(COMPILE) -x '/tests/|py312_intrinsics' $(VENV)/lib && $(COMPILE) src tests

.PHONY: train test clean gpu-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(TRAIN_STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install --quiet --no-compile -c constraints.txt -e .
	$(COMPILE_ALL)
	touch $@

$(DEV_STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install --quiet --no-compile -c constraints.txt -e '.[dev]'
	$(COMPILE_ALL)
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
