# deepserve: `make up` serves the API on the tiny model; `make test` runs unit + integration tests.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
SERVE_STAMP := $(VENV)/.serve-stamp
PYTEST_ARGS ?=

.PHONY: setup lock up test test-gpu test-container image lint mutants clean

setup: $(STAMP)

# Idempotent: re-runs only when the project's dependency list changes. The full setup (test
# extras, Chromium) covers serving too; `make up` alone installs only what serving needs.
$(STAMP): pyproject.toml requirements.lock scripts/setup.sh scripts/install-torch.sh
	bash scripts/setup.sh $(VENV) test
	touch $(STAMP) $(SERVE_STAMP)

$(SERVE_STAMP): pyproject.toml requirements.lock scripts/setup.sh scripts/install-torch.sh
	bash scripts/setup.sh $(VENV) serve
	touch $(SERVE_STAMP)

# Re-pins requirements.lock at the versions .venv runs (after changing a dependency in
# pyproject.toml and passing the tests); the image and the GPU bundle install the same pins.
lock: setup
	$(PY) scripts/lock.py

up: $(SERVE_STAMP)
	$(VENV)/bin/deepserve up

test: setup
	$(PY) -m pytest tests/unit tests/integration -q -p no:cacheprovider $(PYTEST_ARGS)

test-gpu: setup
	$(PY) -m pytest tests/gpu -q

# The slower container tier: builds deepserve:cpu and drives compose.yaml (docker engine and
# docker-compose are installed and started by scripts/docker/ensure-docker.sh). ~5 min warm.
image: setup
	bash scripts/docker/ensure-docker.sh
	bash scripts/docker/build.sh cpu

test-container: image
	$(PY) -m pytest tests/container -q -p no:cacheprovider

# The mutation check, a slower tier outside `make test` (~30 min on 2 cores): each bug of
# scripts/mutants.py's list, planted alone in a scratch copy, must fail the tests listed for it.
# Prints a table; fails if one survives. MUTANTS_ARGS="--only ID,ID" or "--jobs 4". docs/testing.md.
mutants: setup
	$(PY) scripts/mutants.py $(MUTANTS_ARGS)

# Fails on any finding: ruff (rules and the 100-column format) and mypy --strict over the
# libraries, the services and the tools package.
LINT_PATHS := libs services deepserve tests scripts
lint: setup
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy libs services deepserve
	$(PY) scripts/proto_compat.py

clean:
	rm -rf $(VENV) .run
