"""The research guide's examples (docs/examples/*.py, shown in docs/research.md) run as documented on a tiny
fixture; each checks its own result against a reference (finite differences, the engine's un-modified output, the
weights changed to match the intervention)."""

from __future__ import annotations

import runpy
import sys

import pytest
from support.checkpoints import FIXTURES, REPO

EXAMPLES = sorted((REPO / "docs" / "examples").glob("*.py"))


def test_every_example_is_in_the_guide():
    guide = (REPO / "docs" / "research.md").read_text()
    assert EXAMPLES
    for path in EXAMPLES:
        assert f'--8<-- "{path.name}"' in guide, f"{path.name} is not shown in docs/research.md"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_and_checks_itself(path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(path), str(FIXTURES / "tiny-llama")])
    runpy.run_path(str(path), run_name="__main__")
    assert capsys.readouterr().out  # each prints what it found
