#!/usr/bin/env bash
# The import contracts of .importlinter (import-linter), checked on the installed layout: netra_jax with models/ and
# serving/ inside it, as a wheel installs them; the editable install keeps those two in their own folders, which the
# linter's walk of netra_jax/ would not find. The layout is a folder of symbolic links, made and removed here.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LINT=${LINT_IMPORTS:-$ROOT/.venv/bin/lint-imports}
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir "$STAGE/netra_jax"
for entry in "$ROOT"/netra_jax/*; do
  [ "$(basename "$entry")" = __pycache__ ] || ln -s "$entry" "$STAGE/netra_jax/"
done
ln -s "$ROOT/models" "$STAGE/netra_jax/models"
ln -s "$ROOT/serving" "$STAGE/netra_jax/serving"
cd "$STAGE"
PYTHONPATH="$STAGE" "$LINT" --config "$ROOT/.importlinter" --no-cache "$@"
