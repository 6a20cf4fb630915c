"""Every name the README and docs/ import or mention (``from unison... import x``,
``unison.a.b``) still exists: a restructuring may move code, never a public name."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
from typing import Any, Optional

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def _imports(text: str) -> set[tuple[str, Optional[str]]]:
    """(module, name) for every ``from unison... import name`` and ``import unison...`` line."""
    out: set[tuple[str, Optional[str]]] = set()
    for line in text.splitlines():
        line = line.strip().strip("`")
        if not re.match(r"(from|import) unison\b", line):
            continue
        try:
            tree = ast.parse(line.rstrip("(\\").split("  #")[0])
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module:
                out.update((node.module, a.name) for a in node.names)
            elif isinstance(node, ast.Import):
                out.update((a.name, None) for a in node.names)
    return out


#: The library's logger names (``logging.getLogger("unison.ft")``): documented, but not importable.
LOGGERS = {
    name
    for path in (ROOT / "unison").rglob("*.py")
    for name in re.findall(r"getLogger\(\"(unison[\w.]*)\"\)", path.read_text())
}


def _mentions(text: str) -> set[tuple[str, Optional[str]]]:
    """Dotted ``unison.x.y`` names written in the prose and code (not file paths, not logger names)."""
    found = set(re.findall(r"(?<![\w/.])unison(?:\.[A-Za-z_]\w*)+", text))
    return {(m, None) for m in found - LOGGERS}


def _resolve(dotted: str, name: Optional[str]) -> Any:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in [*parts[i:], *([name] if name else [])]:
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                obj = importlib.import_module(f"{obj.__name__}.{attr}")  # a submodule not imported yet
        return obj
    raise ImportError(dotted)


NAMES = sorted(
    {(page.name, *ref) for page in PAGES for ref in _imports(page.read_text()) | _mentions(page.read_text())}, key=str
)


def test_the_pages_name_something():
    assert len(NAMES) > 30


@pytest.mark.parametrize("page,module,name", NAMES)
def test_every_documented_name_imports(page: str, module: str, name: Optional[str]) -> None:
    assert _resolve(module, name) is not None
