"""mkdocs hooks: the site shows files that live outside docs/, and the list of every error.

- A link or image written ``../PATH`` in a page (so it resolves on GitHub too: the plots in
  benchmarks/results/, the scripts in examples/) is copied into the site as ``repo/PATH`` and
  the link rewritten to it; a ``../PATH`` that does not exist fails the strict build.
- ``<!-- errors -->`` in a page becomes the tables of every ``raise ...Error(...)`` under
  unison/, read from the source at build time, so the list cannot go stale.
"""

from __future__ import annotations

import ast
import logging
import os
import re

from mkdocs.structure.files import File, Files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTSIDE = re.compile(r"\]\(\.\./([^)#\s]+)(#[^)\s]*)?\)")
log = logging.getLogger("mkdocs.hooks.unison")


def _outside_links(config) -> set[str]:
    found = set()
    for name in os.listdir(config["docs_dir"]):
        if name.endswith(".md"):
            with open(os.path.join(config["docs_dir"], name), encoding="utf-8") as f:
                found.update(m.group(1) for m in OUTSIDE.finditer(f.read()))
    return found


def on_files(files: Files, config) -> Files:
    for path in sorted(_outside_links(config)):
        if not os.path.isfile(os.path.join(ROOT, path)):
            continue  # reported by on_page_markdown, which knows the page
        files.append(File.generated(config, f"repo/{path}", abs_src_path=os.path.join(ROOT, path)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    def rewrite(m: re.Match) -> str:
        path = m.group(1)
        if not os.path.isfile(os.path.join(ROOT, path)):
            log.warning(f"{page.file.src_uri}: ../{path} is no file in the repository")
            return m.group(0)
        depth = page.file.src_uri.count("/")
        return f"]({'../' * depth}repo/{path}{m.group(2) or ''})"

    markdown = OUTSIDE.sub(rewrite, markdown)
    if "<!-- errors -->" in markdown:
        markdown = markdown.replace("<!-- errors -->", errors_tables())
    return markdown


# What a user was doing when a module raises, by the module's path under unison/.
GROUPS = [
    ("Starting the processes: `unison.init`, launchers", ("runtime/launch.py", "runtime/__init__.py")),
    ("Wrapping the model: `DataParallel` and its options", ("parallel.py", "ddp_keywords.py", "core.py", "sharded.py")),
    ("Choosing an algorithm and its options", ("algorithms/",)),
    (
        "Training steps: backward, hooks, `join`, debug mode",
        ("engine/", "events.py", "comm_hook.py", "join.py", "debug.py", "runtime/health.py"),
    ),
    ("Wrapping the optimizer: `DistributedOptimizer`", ("optim.py",)),
    ("Data: `ShardSampler`, `sharded_loader`", ("data.py",)),
    ("Checkpoints: `unison.save`, `unison.load`", ("checkpoint.py",)),
    ("Fault tolerance: `fault_tolerant=True`, `unison launch`", ("fault/", "runtime/")),
    ("Hugging Face: `UnisonTrainer`, `UnisonAccelerator`", ("integrations/huggingface/",)),
    ("Lightning: `UnisonStrategy`", ("integrations/",)),
    ("Migrating: the HeAT, Bagua and torch layers", ("compat/",)),
    ("The command line: `unison train`, `unison bench`", ("apps/",)),
]


def _message(node: ast.expr) -> str:
    """The message of a raise, with each computed part shown as ``{...}``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{…}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        return _message(node.left) + ("" if isinstance(node.op, ast.Add) else " …") + _message(node.right)
    return "{" + ast.unparse(node)[:60] + "}"


def raises() -> list[tuple[str, int, str, str]]:
    """(path under unison/, line, error type, message) of every ``raise X(...)`` whose type ends in
    Error or is RankFailure."""
    out = []
    base = os.path.join(ROOT, "unison")
    for folder, _, names in sorted(os.walk(base)):
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                    continue
                func = node.exc.func
                kind = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if not (kind.endswith("Error") or kind == "RankFailure"):
                    continue
                msg = _message(node.exc.args[0]) if node.exc.args else ""
                out.append((os.path.relpath(path, base).replace(os.sep, "/"), node.lineno, kind, msg))
    return sorted(out)


def _group(rel: str) -> int:
    for i, (_, prefixes) in enumerate(GROUPS):
        if any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in prefixes):
            return i
    return len(GROUPS) - 1


def errors_tables() -> str:
    rows: list[list[tuple[str, int, str, str]]] = [[] for _ in GROUPS]
    for entry in raises():
        rows[_group(entry[0])].append(entry)
    parts = []
    for (title, _), entries in zip(GROUPS, rows):
        if not entries:
            continue
        parts.append(
            f"### {title}\n\n| error | message (`{{…}}`: filled in at run time) | raised in |\n| --- | --- | --- |"
        )
        for rel, line, kind, msg in entries:
            text = (
                " ".join(msg.split())
                .replace("|", "\\|")
                .replace("<", "&lt;")
                .replace("`", "'")
                .replace("[", "\\[")
                .replace("]", "\\]")
            )
            parts.append(f"| `{kind}` | {text} | `unison/{rel}:{line}` |")
        parts.append("")
    return "\n".join(parts)
