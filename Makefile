# The two README commands. Each makes or refreshes .venv itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint format install services clean

run: $(STAMP)
	$(BIN)/weir demo

test: $(STAMP)
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1 \
	  || echo "note: chromium is not installed; tests/ui will be skipped" >&2
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

install: $(STAMP)

# Reinstall whenever the project's requirements change. torch==2.13.0 comes from the local CPU wheel
# when pip finds one; otherwise from PyPI.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# PostgreSQL and Redis for the tests, started when they are not up.
services:
	@bash .ci/services

clean:
	rm -rf $(VENV) var .pytest_cache .ruff_cache
