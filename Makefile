# The two README commands. Each makes or refreshes .venv itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Worker processes for the suite (pytest-xdist). Its tests wait on subprocesses, servers and sockets
# much of the time, so two workers on a 2-core machine take 11 minutes instead of 19-20; each test
# has its own databases, Redis prefix and ports, so workers never share state.
TEST_WORKERS ?= 2

.PHONY: run test lint format install lock services clean

run: $(STAMP)
	$(BIN)/weir demo

test: $(STAMP)
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1 \
	  || echo "note: chromium is not installed; tests/ui will be skipped" >&2
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

install: $(STAMP)

# Reinstall whenever the project's requirements change. torch==2.13.0 comes from the local CPU wheel
# when pip finds one; otherwise from PyPI. constraints.txt holds the versions the suite last passed
# with, so a dependency's new release cannot turn a clean checkout red on its own; `make lock` moves
# them to the newest pyproject.toml allows (then run `make test`).
$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

LOCK_VENV := $(or $(TMPDIR),/tmp)/weir-lock-venv

lock:
	rm -rf $(LOCK_VENV) && $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --upgrade pip
	$(LOCK_VENV)/bin/python -m pip install -q -e '.[dev]'
	{ echo "# What make install/test install (pip -c): versions the suite passed with. make lock refreshes it."; \
	  echo "# torch is left out: pyproject.toml pins it, and the CPU wheel's version carries a +cpu tag."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --exclude-editable | grep -v '^torch=='; } > constraints.txt
	rm -rf $(LOCK_VENV)

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
