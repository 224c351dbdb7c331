#!/usr/bin/env bash
# Serving comparison on the default model (SmolLM2-135M-Instruct): netra-jax float32 against llama.cpp's llama-server
# on the same weights as F32 and on the original Q4_1 file, with the same client settings, one engine at a time (each
# server is stopped before the next starts).
#
# Usage:  LLAMA_SERVER=/path/to/llama-server benchmarks/compare_llamacpp.sh [netra-jax bench serve flags]
#   Client defaults: --max-concurrency 1,8,32 --num-prompts 64 --dataset random --input-len 128 --output-len 128
#   --ignore-eos --endpoint completions. Flags given here come after them and win, e.g. a smoke run:
#   benchmarks/compare_llamacpp.sh --max-concurrency 2 --num-prompts 4 --output-len 8
# Environment:
#   LLAMA_SERVER  llama.cpp's llama-server binary (required; built outside the repository, never committed)
#   GGUF          the Q4_1 model file (default: the default model, located or fetched by netra_jax.assets)
#   THREADS=2 PARALLEL=32 CTX_PER_SLOT=512   llama-server --threads, --parallel and -c PARALLEL*CTX_PER_SLOT
#   SERVER_ARGS   extra `netra-jax serve` flags (it always gets --dtype float32)
#   ENGINES="netra_jax_f32 llamacpp_f32 llamacpp_q4_1"   which runs to do; RESULT_DIR=benchmarks/results
# F32 weights: the Q4_1 file de-quantized with the gguf Python package (python -m netra_jax.bench.gguf_f32), the same
# de-quantization netra-jax's loader applies, so netra-jax float32 and llama.cpp F32 run identical weights; this needs
# no llama-quantize binary. The copy (~540 MB) is written once, next to the Q4_1 file.
# Writes RESULT_DIR/<date>-serve_<engine>.json for each engine, one PNG of all of them, and
# RESULT_DIR/<date>-llamacpp_compare.md (settings and a table of output tok/s, median TTFT and TPOT per concurrency).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
: "${LLAMA_SERVER:?set LLAMA_SERVER to a llama.cpp llama-server binary}"
[ -x "$LLAMA_SERVER" ] || { echo "error: $LLAMA_SERVER is not an executable" >&2; exit 2; }
THREADS=${THREADS:-2}
PARALLEL=${PARALLEL:-32}
CTX_PER_SLOT=${CTX_PER_SLOT:-512}
SERVER_ARGS=${SERVER_ARGS:-}
ENGINES=${ENGINES:-netra_jax_f32 llamacpp_f32 llamacpp_q4_1}
RESULT_DIR=${RESULT_DIR:-benchmarks/results}
BENCH=(--max-concurrency 1,8,32 --num-prompts 64 --dataset random --input-len 128 --output-len 128 --ignore-eos
       --endpoint completions)
BENCH+=("$@")

if [ -n "${GGUF:-}" ]; then
  OURS_MODEL=$(printf '%q' "$GGUF")
  F32=${GGUF%.gguf}.F32.gguf
  F32=${F32/.Q4_1.F32.gguf/.F32.gguf}
  [ -f "$F32" ] || "$PY" -m netra_jax.bench.gguf_f32 "$GGUF" "$F32" >/dev/null
else
  GGUF=$("$PY" -c 'from netra_jax.assets import default_model_path; print(default_model_path())' | tail -n1)
  OURS_MODEL=""  # netra-jax serve's own default: the same file
  F32=$("$PY" -m netra_jax.bench.gguf_f32 --default | tail -n1)
fi
echo "Q4_1: $GGUF"
echo "F32:  $F32"

LLAMA_PID=""
stop_llama() {
  if [ -n "$LLAMA_PID" ] && kill -0 "$LLAMA_PID" 2>/dev/null; then
    kill -TERM "$LLAMA_PID"
    wait "$LLAMA_PID" || true
  fi
  LLAMA_PID=""
}
trap stop_llama EXIT
trap 'exit 130' INT TERM

RESULT=""
bench() {  # bench LABEL ARGS...: one sweep; RESULT = its result file ("" if none was written)
  local label=$1 mark
  shift
  mark=$(mktemp)
  "$PY" -m netra_jax.cli bench serve "${BENCH[@]}" "$@" --label "$label" --result-dir "$RESULT_DIR" --no-plot ||
    echo "warning: $label: the sweep failed or had failed requests" >&2
  RESULT=$(find "$RESULT_DIR" -maxdepth 1 -name "*-serve_$label.json" -newer "$mark" | head -n1)
  rm -f "$mark"
}

run_llama() {  # run_llama LABEL MODEL_FILE: start llama-server, sweep, stop it
  local label=$1 model=$2 port log
  port=$("$PY" -c 'from netra_jax.bench.launch import free_port; print(free_port())')
  log=$(mktemp "${TMPDIR:-/tmp}/llama-server-$label.XXXXXX")
  echo "starting $LLAMA_SERVER on $model (port $port, output in $log)"
  "$LLAMA_SERVER" -m "$model" --alias "$(basename "$model" .gguf)" --host 127.0.0.1 --port "$port" \
    --parallel "$PARALLEL" -c $((PARALLEL * CTX_PER_SLOT)) --cont-batching --threads "$THREADS" >"$log" 2>&1 &
  LLAMA_PID=$!
  bench "$label" --base-url "http://127.0.0.1:$port" --wait-ready 600
  stop_llama
}

FILES=()
LABELS=()
for engine in $ENGINES; do
  echo "=== $engine ==="
  case $engine in
    netra_jax_f32)
      bench "$engine" --launch --server-args="$OURS_MODEL --dtype float32 $SERVER_ARGS"
      name="netra-jax F32" ;;
    llamacpp_f32) run_llama "$engine" "$F32"; name="llama.cpp F32" ;;
    llamacpp_q4_1) run_llama "$engine" "$GGUF"; name="llama.cpp Q4_1" ;;
    *) echo "error: unknown engine $engine" >&2; exit 2 ;;
  esac
  if [ -n "$RESULT" ]; then
    FILES+=("$RESULT")
    LABELS+=("$name")
  fi
done
[ ${#FILES[@]} -gt 0 ] || { echo "error: no results" >&2; exit 1; }

DATE=$(date +%F)
MD="$RESULT_DIR/$DATE-llamacpp_compare.md"
TABLE=$(mktemp)
PLOT=$("$PY" -m netra_jax.cli bench serve --plot "${FILES[@]}" --label "${LABELS[@]}" --result-dir "$RESULT_DIR" \
  --table "$TABLE" | sed -n 's/^wrote \(.*\.png\)$/\1/p')
VERSION=$("$LLAMA_SERVER" --version 2>&1 | grep -m1 -i version || true)
CPU=$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | sed 's/^ //' || true)
BACKEND=$("$PY" -c 'import jax; print(jax.default_backend())' 2>/dev/null | tail -n1)
{
  echo "# Serving: netra-jax vs llama.cpp llama-server ($DATE)"
  echo
  echo "- Model: SmolLM2-135M-Instruct, \`$(basename "$GGUF")\`. netra-jax runs it in float32 (de-quantized at load;"
  echo "  JAX backend $BACKEND); llama.cpp runs the F32 copy of the same weights and the Q4_1 file itself."
  echo "- Client: \`netra-jax bench serve ${BENCH[*]}\`, one engine at a time."
  echo "- llama-server: ${VERSION:-version unknown}; \`--parallel $PARALLEL -c $((PARALLEL * CTX_PER_SLOT))" \
       "--cont-batching --threads $THREADS\`."
  echo "- Machine: $(nproc) CPUs${CPU:+ ($CPU)}. Results: $(printf '`%s` ' "${FILES[@]##*/}")"
  echo "- Plot: \`${PLOT##*/}\`"
  echo
  cat "$TABLE"
} >"$MD"
rm -f "$TABLE"
cat "$MD"
echo "wrote $MD"
