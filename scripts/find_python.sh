#!/usr/bin/env bash
# Print the path of a Python >= 3.12 interpreter (PATH first, then pyenv), or fail with a clear message.
set -u
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
for c in "${PYTHON:-}" python3.13 python3.12 python3 python; do
  [ -n "$c" ] || continue
  p=$(command -v "$c" 2>/dev/null) || continue
  if ok "$p"; then echo "$p"; exit 0; fi
done
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root)
  for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9]|[2-9][0-9])' | sort -t. -k1,1n -k2,2n -k3,3n -r); do
    p="$root/versions/$v/bin/python"
    if [ -x "$p" ] && ok "$p"; then echo "$p"; exit 0; fi
  done
fi
for p in /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9]; do
  if [ -x "$p" ] && ok "$p"; then echo "$p"; exit 0; fi
done
echo "error: netra_jax needs Python >= 3.12 (jax 0.11 requires it) and none was found on PATH or in pyenv." >&2
echo "       Install one (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12." >&2
exit 1
