# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint model-table clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --upgrade --quiet pip
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

# the main job: train the default ViT on the embedded digits data on the CPU, print test accuracy and the run dir
demo: $(STAMP)
	$(BIN)/vitlab train

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q

test-all: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q -m "slow or not slow"

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts benchmarks

model-table: $(STAMP)
	$(BIN)/python scripts/gen_model_table.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
