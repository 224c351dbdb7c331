# Two commands for a fresh machine:  `make setup serve` (or `make run`) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup test test-fast docs imports lint format run serve chat bench bench-serve bench-offline bench-spec bench-score gpu-compile-setup gpu-compile gpu-bundles clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || { interp=$$(scripts/find_python.sh) && echo "creating $(VENV) with $$interp" && "$$interp" -m venv $(VENV); }
	@$(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' || { echo "error: $(VENV) is not Python >= 3.12; remove it and rerun make setup" >&2; exit 1; }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@# the C++ CPU kernels, built for this CPU now rather than at the first start (about 30 s on 2 cores)
	$(PY) -c 'from netra_jax.ops import cpu_kernels; print("C++ CPU kernels:", cpu_kernels.build())' || echo "warning: the C++ CPU kernels did not build; the engine runs its XLA paths"
	@touch $(STAMP)

# `make test` builds the documentation and checks the import contracts first: a docstring that breaks the API
# reference, or an import against the layering, fails CI. The GPU compile check's tests (tests/benchmarks/test_gpu_compile.py)
# run when `make gpu-compile-setup` installed the CUDA wheels, else skip.
test: setup docs imports
	NETRA_JAX_CUDA_SITE=$(abspath $(CUDA_SITE)) $(PY) -m pytest $(PYTEST_ARGS)

# The suite without the tests that start real servers (tests/server, tests/reliability) and without the slow ones
# (SmolLM2 end to end, Ray, the GPU compile check, the GPU check's dry run): what an edit to the engine, a kernel or a
# loader needs. CI runs `make test`.
test-fast: setup
	$(PY) -m pytest -m "not slow and not server and not reliability" $(PYTEST_ARGS)

# Documentation site (mkdocs.yml; pages in docs/, API reference from the docstrings) into site/. --strict makes every
# warning an error, mkdocstrings' docstring warnings included. NO_MKDOCS_2_WARNING silences mkdocs-material's banner.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# The layering (.importlinter, import-linter): models/ and ops/ never import the engine or the server, the engine never
# imports the server, and no package or module imports a sibling that imports it back.
imports: setup
	scripts/lint_imports.sh

lint: setup imports
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
# stops the server; writes benchmarks/results/<date>-serve_netra_jax.json and .png. Then the long-context point, on a
# fresh server: one user, 3 random prompts of 6000 tokens, 32 output tokens each (<date>-serve_netra_jax_long.json;
# BENCH_LONG=0 skips it). About 12 minutes on a 2-core CPU (requests beyond the server's --max-num-seqs, 64 by
# default, wait in its queue). A quick one:
#   make bench-serve BENCH_CONCURRENCY=1,4,16 BENCH_PROMPTS=16 BENCH_LONG=0
# Engine flags go through BENCH_SERVER_ARGS (e.g. "--dtype float32 --max-num-seqs 128"); more client flags
# (--warmup 8, --request-rate ...) through BENCH_ARGS (both sweeps).
BENCH_CONCURRENCY ?= 1,4,16,64,256,512
BENCH_PROMPTS ?= 8,16,32,128,256,512
BENCH_SERVER_ARGS ?=
BENCH_ARGS ?=
BENCH_LONG ?= 1
bench-serve: setup
	$(VENV)/bin/netra-jax bench serve --launch --server-args="$(BENCH_SERVER_ARGS)" \
		--max-concurrency $(BENCH_CONCURRENCY) --num-prompts $(BENCH_PROMPTS) --dataset random \
		--input-len 256 --output-len 64 --ignore-eos --label netra_jax $(BENCH_ARGS)
	@if [ "$(BENCH_LONG)" != 0 ]; then set -x; $(VENV)/bin/netra-jax bench serve --launch \
		--server-args="$(BENCH_SERVER_ARGS)" --max-concurrency 1 --num-prompts 3 --dataset random \
		--input-len 6000 --output-len 32 --ignore-eos --label netra_jax_long $(BENCH_ARGS); fi

# Offline throughput (LLM.generate, 64 chat prompts x 128 tokens, float32) against Hugging Face generate when its
# interpreter is found (see the top of benchmarks/offline_throughput.py); BENCH_OFFLINE_ARGS="--quick --no-hf" for a
# smoke run.
BENCH_OFFLINE_ARGS ?=
bench-offline: setup
	$(PY) -m benchmarks.offline_throughput $(BENCH_OFFLINE_ARGS)

# Speculative decoding, offline A/B in one process (benchmarks/spec_decode.py): the default model in float32 with
# n-gram speculation against none, greedy, on benchmarks/prompts/grounded.jsonl (copy/edit/summarize a given text) and
# chat.jsonl (free-form) at batch 1 and 8, 3 repeats; output tok/s of each, the ratio, acceptance, and a check that the
# greedy tokens are identical (exit status 1 otherwise). Writes benchmarks/results/<date>-spec_decode.json and .md.
# About 40 minutes on a 2-core CPU; BENCH_SPEC_ARGS="--quick" for a smoke run, "--sets grounded --batch 1" for the
# headline point only.
BENCH_SPEC_ARGS ?=
bench-spec: setup
	$(PY) -m benchmarks.spec_decode $(BENCH_SPEC_ARGS)

# Scoring (LLM.score_continuations, 64 five-shot multiple-choice pairs, float32) against transformers' batched forward
# on the same weights and token ids when its interpreter is found (benchmarks/hf_baseline.py), sums checked to 1e-3
# (exit status 1 otherwise). Writes benchmarks/results/<date>-score_bench.json and .md. About 6 minutes on a 2-core
# CPU; BENCH_SCORE_ARGS="--no-hf --repeats 1" for a smoke run.
BENCH_SCORE_ARGS ?=
bench-score: setup
	$(PY) -m benchmarks.score_bench $(BENCH_SCORE_ARGS)

# The GPU compile check without a GPU (benchmarks/gpu_compile): the CUDA 13 plugin and the two NVIDIA wheels a
# deviceless compile reads (ptxas, libdevice; about 10 s; the runtime libraries of its [with-cuda] extra, cuBLAS,
# cuDNN, NCCL and the rest, 3 GB that only a device loads, are left out) go into their own directory,
# $(CUDA_SITE), which only the check's processes import, so the rest of the suite never sees a CUDA plugin.
# `make gpu-compile` compiles every kernel configuration and every step program at full depth for the H100, H200 and
# A100 targets and writes benchmarks/results/<date>-gpu_compile-{h100,h200,a100}.json and .md (about 20 minutes on 2
# cores; CI runs it for the H100 and A100 with 2-layer step programs through the tests); GPU_COMPILE_ARGS="--only
# kernels", "--cases mosaic/gemma", "--depth 2" or "--self-test" for parts of it.
# `make gpu-bundles` compiles the GPU check's 8B serving engine with bf16 weights for the H100 and the H200 into
# benchmarks/bundles/<target>-bf16 (git-ignored; 38 programs and 13.8 MiB each, about 2-3 minutes each on 2 cores),
# which benchmarks/gpu_check.sh loads on that device instead of compiling; build them from the commit the device
# runs (a bundle names the sources' digest). The device carries 64 MiB besides the repository: both bundles and the
# wheels take 34. GPU_BUNDLES_ARGS="--targets h100 --variants bf16,fp8" for others.
CUDA_SITE ?= $(VENV)/cuda13
GPU_COMPILE_ARGS ?=
GPU_BUNDLES_ARGS ?= --targets h100,h200 --variants bf16
CUDA_COMPILER_WHEELS := nvidia-cuda-nvcc nvidia-nvvm
gpu-compile-setup: $(CUDA_SITE)/.installed

$(CUDA_SITE)/.installed: $(STAMP)
	v=$$($(PY) -c 'import jax; print(jax.__version__)') && $(PY) -m pip install -q --upgrade --no-deps \
		--target $(CUDA_SITE) jax-cuda13-plugin==$$v jax-cuda13-pjrt==$$v $(CUDA_COMPILER_WHEELS)
	@touch $@

gpu-compile: gpu-compile-setup
	PYTHONPATH=$(abspath $(CUDA_SITE)) $(PY) -m benchmarks.gpu_compile $(GPU_COMPILE_ARGS)

gpu-bundles: gpu-compile-setup
	PYTHONPATH=$(abspath $(CUDA_SITE)) $(PY) -m benchmarks.gpu_check.bundles $(GPU_BUNDLES_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site
