"""One section of the GPU check in its own process: `python -m benchmarks.gpu_check.child NAME PART PRIOR
WORK DEADLINE [--dry-run]` runs `benchmarks.gpu_check.<NAME>.run(section)`, which saves its results to PART as it
goes."""

from __future__ import annotations

import importlib
import json
import signal
import sys
import traceback
import warnings
from pathlib import Path

from benchmarks.gpu_check.common import Section


def _stop(signum, frame) -> None:
    raise SystemExit(f"stopped by signal {signum} at the section's time limit")


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _stop)  # unwind (a launched server is stopped, the results saved) instead of dying
    name, part, prior, work, deadline = argv[:5]
    sec = Section(
        name=name,
        dry="--dry-run" in argv[5:],
        deadline=float(deadline),
        part=Path(part),
        work=Path(work),
        prior=json.loads(Path(prior).read_text()).get("sections", {}),
    )
    sec.save()
    # the Triton lowering and its ops are deprecated in jax 0.11 (the reason for the Mosaic kernel); the check still
    # measures them, so that one warning is silenced here
    warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)
    try:
        importlib.import_module(f"benchmarks.gpu_check.{name}").run(sec)
    except (Exception, SystemExit):  # SystemExit: e.g. the launched server exited or never became ready
        sec.data["error"] = traceback.format_exc()[-3000:]
        sec.save()
        print(sec.data["error"], file=sys.stderr, flush=True)
        return 1
    sec.save()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
