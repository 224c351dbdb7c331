"""Result files of the benchmark scripts: a result document written as indented JSON to the path asked for, or to
<results dir>/<date>-<name>.json, and the path announced."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

__all__ = ["write_result"]


def write_result(doc: dict, name: str, results_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write doc to `out`, or to results_dir/<today>-<name>.json; print and return the path."""
    path = Path(out) if out else Path(results_dir) / f"{datetime.date.today().isoformat()}-{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")
    return path
