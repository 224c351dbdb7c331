"""The environment of a test file run again as its own process (a multi-device worker, a fake server): this
process's, plus the given variables and tests/ on PYTHONPATH so the worker imports `support` as the tests do."""

from __future__ import annotations

import os

from support.checkpoints import REPO


def worker_env(**variables: str) -> dict[str, str]:
    path = [str(REPO / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, **variables, "PYTHONPATH": os.pathsep.join(path)}
