# Two entry points for a fresh machine (see README): `make train` and `make test`.
# Both create .venv and install scaleloop into it, with the tested versions from constraints.txt
# (pyproject.toml gives torch a range; the constraints pin the release the suite runs on).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup train test clean

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

clean:
	rm -rf $(VENV) runs .pytest_cache
