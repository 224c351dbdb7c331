"""Serving benchmark entry point kept for checkouts: the client lives in netra_jax.bench.serve; this is the same as
`netra-jax bench serve ARGS` (see `--help`)."""

import sys

from netra_jax.bench.serve import main

if __name__ == "__main__":
    sys.exit(main())
