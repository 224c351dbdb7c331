#!/usr/bin/env bash
# One command that measures netra_jax on a GPU (sections and budgets: benchmarks/gpu_check/__main__.py).
# Usage: benchmarks/gpu_check.sh RESULTS_DIR [--dry-run] [--budget SECONDS] [--sections device,model,...]
#   Installs the wheels in benchmarks/wheels/ (benchmarks/fetch_wheels.sh fetches them: the serving packages the GPU
#   image lacks) into a temporary site directory with --no-index, lays netra_jax out there as pyproject installs it
#   (models/ and serving/ as netra_jax.models and netra_jax.serving, linked to this checkout) next to a link to the
#   benchmarks package, then runs the sections (python -m benchmarks.gpu_check), each in its own process, and
#   writes RESULTS_DIR/<date>-gpu_check-<device>.json and .md, the serving sweeps' RESULTS_DIR/<date>-gpu_serve-<device>
#   .json, .md and .png, plus gpu_check.log. Compiled programs built here for the device (make gpu-bundles) are
#   loaded from benchmarks/bundles/ when the run carries them.
#   The full run takes at most about 9.5 minutes; --dry-run runs the same sections on the CPU with tiny shapes and the
#   Pallas interpreters (CI runs it), without installing anything.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
  echo "usage: $0 RESULTS_DIR [--dry-run] [--budget SECONDS] [--sections a,b,...]" >&2
  exit 2
fi
RESULTS_DIR="$(mkdir -p "$1" && cd "$1" && pwd)"
shift
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
PY="${PYTHON:-python3}"
DRY=0
BUDGET=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  [[ "${args[i]}" == "--dry-run" ]] && DRY=1
  [[ "${args[i]}" == "--budget" ]] && BUDGET="${args[i + 1]:-}"
done
SITE="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check-site.XXXXXX")"
T0=$(date +%s)

shopt -s nullglob
wheels=("$HERE"/wheels/*.whl)
if (( DRY )); then
  echo "dry run: using this interpreter's packages (${#wheels[@]} wheels in benchmarks/wheels not installed)"
elif (( ${#wheels[@]} )); then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
  echo "installed ${#wheels[@]} wheels into $SITE in $(( $(date +%s) - T0 ))s"
else
  echo "no wheels in $HERE/wheels (benchmarks/fetch_wheels.sh): the serve section needs fastapi, uvicorn, pydantic" >&2
fi

# netra_jax as pyproject.toml installs it ([tool.setuptools.package-dir]), linked to this checkout's sources
mkdir -p "$SITE/netra_jax"
for f in "$REPO"/netra_jax/*; do ln -s "$f" "$SITE/netra_jax/"; done
ln -s "$REPO/models" "$SITE/netra_jax/models"
ln -s "$REPO/serving" "$SITE/netra_jax/serving"
ln -s "$HERE" "$SITE/benchmarks"  # the check's package, and nothing else of the checkout's root
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
(( DRY )) && export JAX_PLATFORMS=cpu

# a backstop: the sections' budget (their sum, 530 s on the device and 370 s in the dry run, or --budget) plus time
# to stop a section at its limit, merge and report (each section already stops at its own limit and the results are
# written after every section, so on the device 30 s keeps the whole run within 9.5 minutes)
if (( ${#BUDGET} )); then LIMIT=$(( ${BUDGET%.*} + 90 )); else LIMIT=$(( DRY ? 460 : 560 )); fi
cd "$RESULTS_DIR"  # not the checkout: `python -m` puts the working directory first on sys.path
set +e
timeout --signal=TERM --kill-after=20 "$LIMIT" "$PY" -m benchmarks.gpu_check "$RESULTS_DIR" "$@" 2>&1 | tee "$RESULTS_DIR/gpu_check.log"
rc=${PIPESTATUS[0]}
rm -rf "$SITE"
echo "gpu_check finished with status $rc after $(( $(date +%s) - T0 ))s"
exit "$rc"
