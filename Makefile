# Two commands for a fresh machine:  `make setup serve` (or `make run`) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup test test-fast lint format run serve chat bench bench-serve bench-offline clean

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

# Serving benchmark on the default model: starts `netra-jax serve` (--launch), sweeps the closed-loop concurrency
# from 1 to 512 users with a prompt count per pass (random prompts of 256 tokens, 64 output tokens with ignore_eos),
# stops the server; writes benchmarks/results/<date>-serve_netra_jax.json and .png. About 10 minutes on a 2-core CPU
# (requests beyond the server's --max-num-seqs, 64 by default, wait in its queue). A quick one:
#   make bench-serve BENCH_CONCURRENCY=1,4,16 BENCH_PROMPTS=16
# Engine flags go through BENCH_SERVER_ARGS (e.g. "--dtype float32 --max-num-seqs 128"); more client flags
# (--warmup 8, --request-rate ...) through BENCH_ARGS.
BENCH_CONCURRENCY ?= 1,4,16,64,256,512
BENCH_PROMPTS ?= 8,16,32,128,256,512
BENCH_SERVER_ARGS ?=
BENCH_ARGS ?=
bench-serve: setup
	$(VENV)/bin/netra-jax bench serve --launch --server-args="$(BENCH_SERVER_ARGS)" \
		--max-concurrency $(BENCH_CONCURRENCY) --num-prompts $(BENCH_PROMPTS) --dataset random \
		--input-len 256 --output-len 64 --ignore-eos --label netra_jax $(BENCH_ARGS)

# Offline throughput (LLM.generate, 64 chat prompts x 128 tokens, float32) against Hugging Face generate when its
# interpreter is found (see the top of benchmarks/offline_throughput.py); BENCH_OFFLINE_ARGS="--quick --no-hf" for a
# smoke run.
BENCH_OFFLINE_ARGS ?=
bench-offline: setup
	$(PY) benchmarks/offline_throughput.py $(BENCH_OFFLINE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
