"""The installed package list in pyproject.toml names every package of the source tree: setuptools installs only the
packages listed there (models/ and serving/ under netra_jax's name), so a package left out works from a checkout's
editable install and is missing from a wheel."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_source_package_is_listed_for_installation():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    folder_of = {name: Path(folder) for name, folder in tool.get("package-dir", {}).items()}
    folder_of.setdefault("netra_jax", Path("netra_jax"))
    found = set()
    for top, folder in folder_of.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join((top, *rel.parts)))
    assert found - listed == set(), "packages missing from [tool.setuptools] packages"
    assert listed - found == set(), "listed packages with no __init__.py"
