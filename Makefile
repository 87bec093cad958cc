# Two entry points for a fresh machine (see README): `make train` and `make test`.
# Both create .venv and install scaleloop into it, with the tested versions from constraints.txt
# (pyproject.toml gives torch a range; the constraints pin the release the suite runs on).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup train test clean gpu-check

$(BIN)/scaleloop: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

setup: $(BIN)/scaleloop

train: setup
	$(BIN)/scaleloop train

test: setup
	$(BIN)/python -m pytest -q

# On a GPU machine (its own torch, no package index): install over that torch, run every CUDA
# path, write benchmarks/<date>_<gpu>_gpu-check.md. GPU_CHECK_FLAGS=--cpu runs the plan without CUDA.
gpu-check:
	$(PYTHON) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PYTHON) tools/gpucheck.py $(GPU_CHECK_FLAGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
