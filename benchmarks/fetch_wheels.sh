#!/usr/bin/env bash
# Download the wheels the GPU check carries to the GPU machine (no network there): each distribution named in
# benchmarks/gpu_wheels.txt, at the version installed in this checkout's .venv, for CPython 3.12 on manylinux x86-64,
# without dependencies (the list names every one the image lacks). Into benchmarks/wheels/ (git-ignored).
# Usage: benchmarks/fetch_wheels.sh [PYTHON]   (default: .venv/bin/python)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
PY="${1:-$REPO/.venv/bin/python}"
DEST="$HERE/wheels"
mkdir -p "$DEST"
rm -f "$DEST"/*.whl

mapfile -t names < <(grep -v '^\s*#' "$HERE/gpu_wheels.txt" | grep -v '^\s*$')
pins=()
for n in "${names[@]}"; do
  v="$("$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$n")"
  pins+=("$n==$v")
done
echo "fetching: ${pins[*]}"
plat=()
for p in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 \
  manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
  manylinux1_x86_64; do
  plat+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d "$DEST" "${pins[@]}"
ls -l "$DEST"
du -sh "$DEST"
