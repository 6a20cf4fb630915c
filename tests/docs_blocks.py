"""The fenced code blocks of README.md and docs/*.md, and how the tests run each.

The convention (CONTRIBUTING.md, "Code blocks in the documentation"): every block runs, unless
the line before it (blank lines aside) is a marker:

- ``<!-- excerpt -->``: a part of a program, a command for a cluster, or what a program prints;
  not run.
- ``<!-- run: torchrun -->``: a Python program run by torchrun on 2 gloo processes.
- ``<!-- run: unison launch -->``: a Python program run by ``unison launch --fault-tolerant --nproc 2``.

An unmarked ``python`` block runs alone in a fresh interpreter (a world of one); an unmarked
``bash`` block runs under ``bash -e``. A block whose whole text is ``--8<-- "examples/NAME.py"``
shows that script on the site; tests/integration/test_examples.py runs it. Any other unmarked
block fails the tests: mark it or make it run.
"""

from __future__ import annotations

import dataclasses
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*(excerpt|run:\s*torchrun|run:\s*unison launch)\b.*-->\s*$")
INCLUDE = re.compile(r'^--8<--\s+"(examples/[\w.-]+\.py)"$')


@dataclasses.dataclass
class Block:
    path: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str
    marker: str  # "", "excerpt", "torchrun" or "unison launch"
    code: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def include(self) -> str | None:
        m = INCLUDE.match(self.code.strip())
        return m.group(1) if m else None

    @property
    def how(self) -> str:
        """How the tests run it: excerpt, example, torchrun, unison launch, python, bash or "unrunnable"."""
        if self.marker:
            return self.marker
        if self.include:
            return "example"
        if self.lang in ("python", "py"):
            return "python"
        if self.lang in ("bash", "sh", "shell"):
            return "bash"
        return "unrunnable"


def documents() -> list[str]:
    docs = sorted(f"docs/{f}" for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    return ["README.md", "CONTRIBUTING.md", *docs]


def blocks(path: str) -> list[Block]:
    """The code blocks of ``path``, relative to the repository root."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return parse(path, f.read())


def parse(path: str, text: str) -> list[Block]:
    """The code blocks of a Markdown ``text``; ``path`` names it in the blocks' ids and errors."""
    lines = text.split("\n")
    out, i, last = [], 0, ""
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].strip():
                last = lines[i]
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3)
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence[0] * len(fence)):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{path}:{start + 1}: a code block that is never closed")
        mk = MARKER.match(last)
        marker = "" if not mk else "excerpt" if mk.group(1) == "excerpt" else mk.group(1).split(":")[1].strip()
        out.append(Block(path, start + 1, lang, marker, "\n".join(body) + "\n"))
        last, i = "", i + 1
    return out


def all_blocks() -> list[Block]:
    return [b for path in documents() if os.path.exists(os.path.join(ROOT, path)) for b in blocks(path)]
