#!/usr/bin/env bash
# Serving comparison on the default model (SmolLM2-135M-Instruct): netra-jax float32 against llama.cpp's llama-server
# on the same weights as F32 and on the original Q4_1 file, with the same client settings, one engine at a time (each
# server is stopped before the next starts).
#
# Usage:  LLAMA_SERVER=/path/to/llama-server [PRESET=...] benchmarks/compare_llamacpp.sh [netra-jax bench serve flags]
# Presets (client flags; flags given here come after them and win, e.g. a smoke run:
# benchmarks/compare_llamacpp.sh --max-concurrency 2 --num-prompts 4 --output-len 8):
#   random    (default) --max-concurrency 1,8,32 --num-prompts 64 --dataset random --input-len 128 --output-len 128
#             --ignore-eos --endpoint completions; ENGINES="netra_jax_f32 llamacpp_f32 llamacpp_q4_1"
#   grounded  speculative decoding where it pays: the chat requests of benchmarks/prompts/grounded.jsonl (copy, edit,
#             convert or summarize a given text; greedy, each stops at its end or its max_tokens), --max-concurrency 1,8
#             --num-prompts 24,48 --endpoint chat; each engine without and with n-gram speculation:
#             ENGINES="netra_jax_f32 netra_jax_f32_spec llamacpp_f32 llamacpp_f32_spec", PARALLEL=8 CTX_PER_SLOT=1024
#             (the 24 requests repeat from pass to pass: both engines' prompt caches can shorten TTFT after the first)
#   chat      the same on free-form questions (benchmarks/prompts/chat.jsonl): where speculation finds little to copy
#   long      long context: one user, 6000-token random prompts, 32 output tokens (--max-concurrency 1 --num-prompts 3
#             --input-len 6000 --output-len 32 --ignore-eos); ENGINES="netra_jax_f32 llamacpp_f32", PARALLEL=1
#             CTX_PER_SLOT=8192
#   quantized the random preset's client on the GGUF file as it is, both engines keeping its quantized blocks, each
#             with its default flags: ENGINES="netra_jax_gguf llamacpp_gguf" (GGUF=any file, e.g.
#             `python -m benchmarks.random_gguf`'s)
# Environment:
#   LLAMA_SERVER  llama.cpp's llama-server binary (required; built outside the repository, never committed)
#   GGUF          the Q4_1 model file (default: the default model, located or fetched by netra_jax.assets)
#   THREADS=2 PARALLEL CTX_PER_SLOT   llama-server --threads, --parallel and -c PARALLEL*CTX_PER_SLOT (preset defaults)
#   SERVER_ARGS   extra `netra-jax serve` flags (it always gets --dtype float32)
#   ENGINES       which runs to do, in order (preset default); any of netra_jax_f32 netra_jax_f32_spec
#                 netra_jax_f32_xla (no C++ CPU kernel: --matmul-backend xla --attention-backend reference, XLA's
#                 dot and the jnp attention) netra_jax_gguf (the GGUF file itself, its GGML blocks kept, default
#                 flags: the blocks times int8-rounded activations, llama.cpp's arithmetic)
#                 netra_jax_gguf_f32x (the same with --matmul-backend cpu_rows: float32 activations)
#                 llamacpp_f32 llamacpp_f32_spec llamacpp_q4_1 llamacpp_q4_1_spec (llamacpp_gguf: the same, named
#                 for any file)
#   TAG           appended to every result's label and to the report's name (a second run on the same day keeps the
#                 first one's files; the quantized preset puts the GGUF file's name before it)
#   SPEC_K=5 SPEC_NGRAM_MAX=4 SPEC_NGRAM_MIN=2   n-gram speculation of the *_spec runs: netra-jax gets
#                 --speculative-config '{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": MAX,
#                 "prompt_lookup_min": MIN}'; llama-server its prompt-lookup equivalent, LLAMA_SPEC_ARGS (default
#                 "--spec-type ngram-simple --spec-ngram-simple-size-n MIN --spec-ngram-simple-size-m K": look up the
#                 last MIN tokens in the context, draft the K that followed them)
#   RESULT_DIR=benchmarks/results
# F32 weights: the Q4_1 file de-quantized with the gguf Python package (python -m netra_jax.bench.gguf_f32), the same
# de-quantization netra-jax's loader applies, so netra-jax float32 and llama.cpp F32 run identical weights; this needs
# no llama-quantize binary. The copy (~540 MB) is written once, next to the Q4_1 file, when an *_f32 engine runs.
# netra-jax reads a GGUF file's Q4_0 ... Q6_K blocks as they are (netra_jax_gguf); netra_jax_f32 serves the F32 copy.
# Writes RESULT_DIR/<date>-serve_<preset>_<engine>.json for each engine (random: <date>-serve_<engine>.json), one PNG
# of all of them, and RESULT_DIR/<date>-llamacpp_compare[_<preset>].md: settings, the machine (CPU, speed flags, jax)
# and a table of output tok/s, median TTFT and TPOT per concurrency, with the draft acceptance rate and mean
# acceptance length read from each server's /metrics when speculation ran; then each row against the machine's own
# limits, measured before and after the runs (netra_jax.bench.limits: read bandwidth, float32 FMA peak): the decode
# step's bytes and FLOPs over its TPOT, so that a ratio that moves between hosts can be read against the host.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
: "${LLAMA_SERVER:?set LLAMA_SERVER to a llama.cpp llama-server binary}"
[ -x "$LLAMA_SERVER" ] || { echo "error: $LLAMA_SERVER is not an executable" >&2; exit 2; }
PRESET=${PRESET:-random}
PROMPTS=benchmarks/prompts
case $PRESET in
  random)
    BENCH=(--max-concurrency 1,8,32 --num-prompts 64 --dataset random --input-len 128 --output-len 128 --ignore-eos
           --endpoint completions)
    DEFAULT_ENGINES="netra_jax_f32 llamacpp_f32 llamacpp_q4_1"; DEFAULT_PARALLEL=32; DEFAULT_CTX=512 ;;
  grounded | chat)
    BENCH=(--max-concurrency 1,8 --num-prompts 24,48 --dataset jsonl --dataset-path "$PROMPTS/$PRESET.jsonl"
           --endpoint chat)
    DEFAULT_ENGINES="netra_jax_f32 netra_jax_f32_spec llamacpp_f32 llamacpp_f32_spec"; DEFAULT_PARALLEL=8
    DEFAULT_CTX=1024 ;;
  long)
    BENCH=(--max-concurrency 1 --num-prompts 3 --dataset random --input-len 6000 --output-len 32 --ignore-eos
           --endpoint completions)
    DEFAULT_ENGINES="netra_jax_f32 llamacpp_f32"; DEFAULT_PARALLEL=1; DEFAULT_CTX=8192 ;;
  quantized)
    BENCH=(--max-concurrency 1,8,32 --num-prompts 64 --dataset random --input-len 128 --output-len 128 --ignore-eos
           --endpoint completions)
    DEFAULT_ENGINES="netra_jax_gguf llamacpp_gguf"; DEFAULT_PARALLEL=32; DEFAULT_CTX=512 ;;
  *) echo "error: unknown PRESET $PRESET (random, grounded, chat, long, quantized)" >&2; exit 2 ;;
esac
BENCH+=("$@")
THREADS=${THREADS:-2}
PARALLEL=${PARALLEL:-$DEFAULT_PARALLEL}
CTX_PER_SLOT=${CTX_PER_SLOT:-$DEFAULT_CTX}
SERVER_ARGS=${SERVER_ARGS:-}
ENGINES=${ENGINES:-$DEFAULT_ENGINES}
RESULT_DIR=${RESULT_DIR:-benchmarks/results}
SPEC_K=${SPEC_K:-5}
SPEC_NGRAM_MAX=${SPEC_NGRAM_MAX:-4}
SPEC_NGRAM_MIN=${SPEC_NGRAM_MIN:-2}
SPEC_JSON="{\"method\": \"ngram\", \"num_speculative_tokens\": $SPEC_K, \"prompt_lookup_max\": $SPEC_NGRAM_MAX,"
SPEC_JSON+=" \"prompt_lookup_min\": $SPEC_NGRAM_MIN}"
NETRA_SPEC_ARGS="--speculative-config '$SPEC_JSON'"
LLAMA_SPEC_DEFAULT="--spec-type ngram-simple --spec-ngram-simple-size-n $SPEC_NGRAM_MIN"
LLAMA_SPEC_DEFAULT+=" --spec-ngram-simple-size-m $SPEC_K"
LLAMA_SPEC_ARGS=${LLAMA_SPEC_ARGS:-$LLAMA_SPEC_DEFAULT}
PREFIX=""  # result labels: <preset>_<engine>[_<file>][_<TAG>] except for the default preset
[ "$PRESET" = random ] || PREFIX="${PRESET}_"
SUFFIX=${TAG:+_$TAG}
if [ "$PRESET" = quantized ] && [ -n "${GGUF:-}" ]; then  # runs on two files the same day keep their own results
  STEM=$(basename "$GGUF" .gguf)
  SUFFIX="_${STEM//[^A-Za-z0-9_]/_}$SUFFIX"
fi

F32=""
if [ -n "${GGUF:-}" ]; then
  OURS_MODEL=$(printf '%q' "$GGUF")
  case " $ENGINES " in
    *_f32*)
      F32=${GGUF%.gguf}.F32.gguf
      F32=${F32/.Q4_1.F32.gguf/.F32.gguf}
      [ -f "$F32" ] || "$PY" -m netra_jax.bench.gguf_f32 "$GGUF" "$F32" >/dev/null ;;
  esac
else
  GGUF=$("$PY" -c 'from netra_jax.assets import default_model_path; print(default_model_path())' | tail -n1)
  OURS_MODEL=""  # netra-jax serve's own default: the same file
  case " $ENGINES " in *_f32*) F32=$("$PY" -m netra_jax.bench.gguf_f32 --default | tail -n1) ;; esac
fi
echo "preset $PRESET; GGUF: $GGUF; F32: ${F32:-not needed}"

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

run_llama() {  # run_llama LABEL MODEL_FILE [llama-server flags]: start llama-server, sweep, stop it
  local label=$1 model=$2 port log
  shift 2
  port=$("$PY" -c 'from netra_jax.bench.launch import free_port; print(free_port())')
  log=$(mktemp "${TMPDIR:-/tmp}/llama-server-$label.XXXXXX")
  echo "starting $LLAMA_SERVER on $model (port $port, output in $log)"
  "$LLAMA_SERVER" -m "$model" --alias "$(basename "$model" .gguf)" --host 127.0.0.1 --port "$port" \
    --parallel "$PARALLEL" -c $((PARALLEL * CTX_PER_SLOT)) --cont-batching --threads "$THREADS" --metrics \
    "$@" >"$log" 2>&1 &
  LLAMA_PID=$!
  bench "$label" --base-url "http://127.0.0.1:$port" --wait-ready 600
  stop_llama
}

LIMITS_BEFORE=$(mktemp) LIMITS_AFTER=$(mktemp)  # this machine's read bandwidth and FMA peak, around the runs
"$PY" -m netra_jax.bench.limits measure "$LIMITS_BEFORE"

FILES=()
LABELS=()
FRACTIONS=()  # per result: --result JSON LABEL KV_BYTES MODEL for the limits table
for engine in $ENGINES; do
  echo "=== $engine ==="
  label=$PREFIX$engine$SUFFIX
  case $engine in
    netra_jax_f32)
      bench "$label" --launch --server-args="$(printf '%q' "$F32") --dtype float32 $SERVER_ARGS"
      name="netra-jax F32" ;;
    netra_jax_f32_spec)
      bench "$label" --launch --server-args="$(printf '%q' "$F32") --dtype float32 $NETRA_SPEC_ARGS $SERVER_ARGS"
      name="netra-jax F32 n-gram" ;;
    netra_jax_f32_xla)
      bench "$label" --launch --server-args="$(printf '%q' "$F32") --dtype float32 --matmul-backend xla \
        --attention-backend reference $SERVER_ARGS"
      name="netra-jax F32 XLA only" ;;
    netra_jax_gguf)
      bench "$label" --launch --server-args="$OURS_MODEL --dtype float32 $SERVER_ARGS"
      name="netra-jax $(basename "$GGUF" .gguf)" ;;
    netra_jax_gguf_f32x)
      bench "$label" --launch --server-args="$OURS_MODEL --dtype float32 --matmul-backend cpu_rows $SERVER_ARGS"
      name="netra-jax $(basename "$GGUF" .gguf) float activations" ;;
    llamacpp_f32) run_llama "$label" "$F32"; name="llama.cpp F32" ;;
    # shellcheck disable=SC2086  # LLAMA_SPEC_ARGS: several flags
    llamacpp_f32_spec) run_llama "$label" "$F32" $LLAMA_SPEC_ARGS; name="llama.cpp F32 n-gram" ;;
    llamacpp_q4_1) run_llama "$label" "$GGUF"; name="llama.cpp Q4_1" ;;
    # shellcheck disable=SC2086
    llamacpp_q4_1_spec) run_llama "$label" "$GGUF" $LLAMA_SPEC_ARGS; name="llama.cpp Q4_1 n-gram" ;;
    llamacpp_gguf) run_llama "$label" "$GGUF"; name="llama.cpp $(basename "$GGUF" .gguf)" ;;
    *) echo "error: unknown engine $engine" >&2; exit 2 ;;
  esac
  if [ -n "$RESULT" ]; then
    FILES+=("$RESULT")
    LABELS+=("$name")
    case $engine in *_f32*) served=$F32 ;; *) served=$GGUF ;; esac
    case $engine in llamacpp_*) kv_bytes=2 ;; *) kv_bytes=4 ;; esac  # llama-server's f16 KV; our float32 one
    FRACTIONS+=(--result "$RESULT" "$name" "$kv_bytes" "$served")
  fi
done
"$PY" -m netra_jax.bench.limits measure "$LIMITS_AFTER"
[ ${#FILES[@]} -gt 0 ] || { echo "error: no results" >&2; exit 1; }

DATE=$(date +%F)
MD="$RESULT_DIR/$DATE-llamacpp_compare${PREFIX:+_$PRESET}$SUFFIX.md"
TABLE=$(mktemp)
PLOT_DIR=$(mktemp -d)  # drawn aside, then moved in tagged like the table: an earlier run's plot of the day stays
PLOT=$("$PY" -m netra_jax.cli bench serve --plot "${FILES[@]}" --label "${LABELS[@]}" --result-dir "$PLOT_DIR" \
  --table "$TABLE" | sed -n 's/^wrote \(.*\.png\)$/\1/p')
if [ -n "$PLOT" ]; then
  NAME=$(basename "$PLOT" .png)
  PLOT_NAME="$NAME${PREFIX:+_$PRESET}$SUFFIX.png"  # the preset too: a long run's plot must not replace a random one's
  mv "$PLOT" "$RESULT_DIR/$PLOT_NAME"
  PLOT="$RESULT_DIR/$PLOT_NAME"
fi
rmdir "$PLOT_DIR" 2>/dev/null || true
VERSION=$("$LLAMA_SERVER" --version 2>&1 | grep -m1 -i version || true)
MACHINE=$("$PY" -c 'from netra_jax.bench.machine import describe, machine_info; print(describe(machine_info()))')
BACKEND=$("$PY" -c 'import jax; print(jax.default_backend())' 2>/dev/null | tail -n1)
{
  echo "# Serving: netra-jax vs llama.cpp llama-server, preset $PRESET ($DATE)"
  echo
  echo "- Model: \`$(basename "$GGUF")\`. The F32 rows run its float32 copy (identical weights, de-quantized by the"
  echo "  gguf package); the other rows the file itself, its quantized blocks kept in memory by both engines (JAX"
  echo "  backend $BACKEND; netra-jax's activations float32, rounded to int8 blocks for the GGUF blocks' products"
  echo "  unless a row says float activations, as llama.cpp rounds them)."
  echo "- Client: \`netra-jax bench serve ${BENCH[*]}\`, one engine at a time."
  echo "- llama-server: ${VERSION:-version unknown}; \`--parallel $PARALLEL -c $((PARALLEL * CTX_PER_SLOT))" \
       "--cont-batching --threads $THREADS --metrics\`."
  case " $ENGINES " in
    *_spec\ *)
      echo "- n-gram speculation (the n-gram rows): netra-jax \`--speculative-config '$SPEC_JSON'\`;" \
           "llama-server \`$LLAMA_SPEC_ARGS\`." ;;
  esac
  echo "- Machine: $MACHINE. Results: $(printf '`%s` ' "${FILES[@]##*/}")"
  echo "- Plot: \`${PLOT##*/}\`"
  echo
  cat "$TABLE"
  echo
  echo "Against this machine's limits (\`python -m netra_jax.bench.limits\`: a decode step's bytes and FLOPs over"
  echo "its median TPOT; the bandwidth fraction is the one-user figure, the FMA fraction the many-user one):"
  echo
  "$PY" -m netra_jax.bench.limits table --limits "$LIMITS_BEFORE" "$LIMITS_AFTER" "${FRACTIONS[@]}"
} >"$MD"
rm -f "$TABLE" "$LIMITS_BEFORE" "$LIMITS_AFTER"
cat "$MD"
echo "wrote $MD"
