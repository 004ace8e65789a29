# deepserve: `make up` serves the API on the tiny model; `make test` runs unit + integration tests.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: setup up test test-gpu lint clean

setup: $(STAMP)

# Idempotent: re-runs only when the project's dependency list changes.
$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $(STAMP)

up: setup
	$(VENV)/bin/deepserve up

test: setup
	$(PY) -m pytest tests/unit tests/integration -q -p no:cacheprovider $(PYTEST_ARGS)

test-gpu: setup
	$(PY) -m pytest tests/gpu -q

lint: setup
	$(VENV)/bin/ruff check libs tests || true

clean:
	rm -rf $(VENV) .run
