"""The import contracts (.importlinter, checked by scripts/lint_imports.sh on the installed layout) hold on this tree,
and each kind fails on a copy of it with one wrong import: a model module importing the engine, the engine importing
the server, two modules importing each other."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = ROOT / ".venv" / "bin" / "lint-imports"

pytestmark = pytest.mark.skipif(shutil.which("lint-imports") is None and not LINT.exists(), reason="no import-linter")


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "LINT_IMPORTS": str(LINT if LINT.exists() else shutil.which("lint-imports"))}
    return subprocess.run(
        ["bash", str(root / "scripts" / "lint_imports.sh")], cwd=root, capture_output=True, text=True, env=env
    )


def test_the_tree_keeps_every_contract():
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 kept, 0 broken" in out.stdout


@pytest.mark.parametrize(
    "module, wrong_import, contract",
    [
        ("models/rope.py", "import netra_jax.engine.engine", "models/ and ops/ never import the engine or the server"),
        ("netra_jax/engine/scheduler.py", "import netra_jax.serving.app", "the engine never imports the server"),
        ("netra_jax/options.py", "import netra_jax.engine_config", "no package or module imports a sibling"),
    ],
    ids=["models->engine", "engine->serving", "circle"],
)
def test_a_wrong_import_breaks_its_contract(tmp_path, module, wrong_import, contract):
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    for folder in ("netra_jax", "models", "serving", "scripts"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=ignore)
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    path = tmp_path / module
    path.write_text(path.read_text() + f"\n{wrong_import}  # deliberately against the layering\n")
    out = _lint(tmp_path)
    assert out.returncode != 0
    broken = out.stdout.split("Broken contracts")[-1]
    assert contract in broken, out.stdout
