"""The documentation build's griffe extensions (scripts/griffe_*.py): comment-documented attributes get their comment
as docstring, and the subpackages setuptools maps to other folders load under their installed names."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import griffe
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


field_comments = _script("griffe_field_comments")
package_dirs = _script("griffe_package_dirs")

SOURCE = """
# the page size
# in tokens
page_size: int = 16
url: str = "http://x#not-a-comment"  # where it lives
plain = 3

lonely = 4  # noqa: E501
spread = dict(  # opening line
    a=1,
)  # closing line
"""


def _assignments(code: str) -> dict[str, ast.AST]:
    return {n.targets[0].id if isinstance(n, ast.Assign) else n.target.id: n for n in ast.parse(code).body}


def test_comments_split_trailing_from_standalone_and_skip_strings_and_pragmas():
    trailing, standalone = field_comments.comments(SOURCE)
    assert standalone == {2: "the page size", 3: "in tokens"}
    assert trailing == {5: "where it lives", 9: "opening line", 11: "closing line"}


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("page_size", "the page size in tokens"),  # the block right above, in order
        ("url", "where it lives"),  # a '#' inside the string is not a comment
        ("plain", None),
        ("lonely", None),  # a pragma documents nothing, and a blank line separates it from the block above
        ("spread", "closing line"),  # the comment ending the statement's last line
    ],
)
def test_field_comment(name, want):
    trailing, standalone = field_comments.comments(SOURCE)
    assert field_comments.field_comment(_assignments(SOURCE)[name], trailing, standalone) == want


def test_extensions_load_remapped_subpackages_with_field_comments():
    assert package_dirs.package_dirs() == {"netra_jax.models": ROOT / "models", "netra_jax.serving": ROOT / "serving"}
    extensions = griffe.load_extensions(package_dirs.PackageDirs, field_comments.FieldComments)
    loader = griffe.GriffeLoader(extensions=extensions, search_paths=[str(ROOT)])
    pkg = loader.load("netra_jax")
    forward = pkg["models.transformer.forward"]
    assert forward.is_function and forward.filepath == ROOT / "models" / "transformer.py"
    assert "flat batch of new tokens" in forward.docstring.value
    assert pkg["serving.app.create_app"].filepath == ROOT / "serving" / "app.py"
    field = pkg["engine_config.CacheConfig.page_size"]  # documented by the comment ending its line
    line = (ROOT / "netra_jax" / "engine_config.py").read_text().splitlines()[field.lineno - 1]
    assert field.docstring.value == line.split("#", 1)[1].strip() != ""
