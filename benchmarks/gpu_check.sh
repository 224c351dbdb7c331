#!/usr/bin/env bash
# GPU check of the Pallas attention kernels on a machine with jax + its CUDA plugin, flax and numpy only.
# Usage: benchmarks/gpu_check.sh RESULTS_DIR [--dry-run] [--budget SECONDS]
#   Installs (without dependencies) any wheels in benchmarks/wheels/, puts this checkout on PYTHONPATH and runs
#   benchmarks/gpu_check.py, which writes RESULTS_DIR/gpu_check.json (and a log next to it). The full run stops
#   starting new work after ~9 minutes; --dry-run uses tiny shapes, the CPU and the Pallas interpreter.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
  echo "usage: $0 RESULTS_DIR [--dry-run] [--budget SECONDS]" >&2
  exit 2
fi
RESULTS_DIR="$1"
shift
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
PY="${PYTHON:-python3}"
DRY=0
for a in "$@"; do [[ "$a" == "--dry-run" ]] && DRY=1; done
mkdir -p "$RESULTS_DIR"

shopt -s nullglob
wheels=("$HERE"/wheels/*.whl)
if (( ${#wheels[@]} )); then
  if (( DRY )); then
    echo "dry run: would pip install --no-deps ${wheels[*]}"
  else
    "$PY" -m pip install --no-deps --no-index "${wheels[@]}"
  fi
fi

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if (( DRY )); then
  export JAX_PLATFORMS=cpu
  LIMIT=150
else
  export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
  LIMIT=590
fi
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
timeout --signal=TERM "$LIMIT" "$PY" "$HERE/gpu_check.py" "$RESULTS_DIR" "$@" 2>&1 | tee "$RESULTS_DIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
