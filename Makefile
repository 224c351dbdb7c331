# Two commands for a fresh machine:  `make setup serve` (or `make run`) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup test test-fast lint format run serve chat bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || { interp=$$(scripts/find_python.sh) && echo "creating $(VENV) with $$interp" && "$$interp" -m venv $(VENV); }
	@$(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' || { echo "error: $(VENV) is not Python >= 3.12; remove it and rerun make setup" >&2; exit 1; }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

# Ask the embedded default model (SmolLM2-135M-Instruct) one question.
run: setup
	$(VENV)/bin/netra-jax chat "What is the capital of France?"

serve: setup
	$(VENV)/bin/netra-jax serve

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
