"""Griffe extension for the documentation build: loads the subpackages that live outside `netra_jax/` (`models/` as
`netra_jax.models`, `serving/` as `netra_jax.serving`, read from pyproject's [tool.setuptools.package-dir]).

Griffe finds a package's submodules by walking its folder, so without this it cannot see a subpackage that
setuptools maps to another directory. Named in mkdocs.yml's mkdocstrings `extensions`."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import griffe

_ROOT = Path(__file__).resolve().parent.parent


def package_dirs(pyproject: Path = _ROOT / "pyproject.toml") -> dict[str, Path]:
    """Dotted package name -> its directory, for every entry of [tool.setuptools.package-dir]."""
    table = tomllib.loads(pyproject.read_text())["tool"]["setuptools"].get("package-dir", {})
    return {name: (pyproject.parent / d).resolve() for name, d in table.items() if name}


class PackageDirs(griffe.Extension):
    """Attach each remapped subpackage (and its submodules, recursively) to its loaded parent package."""

    def __init__(self) -> None:
        super().__init__()
        self.dirs = package_dirs()

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        for name, directory in sorted(self.dirs.items()):
            parent_path, _, leaf = name.rpartition(".")
            if parent_path.split(".")[0] != pkg.name:
                continue
            parent = loader.modules_collection.get_member(parent_path)
            module = self._load(loader, leaf, directory / "__init__.py", parent)
            loader.expand_exports(module)

    def _load(self, loader: griffe.GriffeLoader, name: str, path: Path, parent: griffe.Module) -> griffe.Module:
        code = path.read_text(encoding="utf-8")
        if loader.store_source:
            loader.lines_collection[path] = code.splitlines(keepends=False)
        module = griffe.visit(
            name,
            filepath=path,
            code=code,
            extensions=loader.extensions,
            parent=parent,
            docstring_parser=loader.docstring_parser,
            docstring_options=loader.docstring_options,
            lines_collection=loader.lines_collection,
            modules_collection=loader.modules_collection,
        )
        parent.set_member(name, module)
        if path.name == "__init__.py":
            for child in sorted(path.parent.iterdir()):
                if child.suffix == ".py" and child.name != "__init__.py":
                    self._load(loader, child.stem, child, module)
                elif child.is_dir() and (child / "__init__.py").is_file():
                    self._load(loader, child.name, child / "__init__.py", module)
        return module
