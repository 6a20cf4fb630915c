"""The architecture holds: algorithms see only the Replica, the layers import downwards,
algorithms are laid out by family, and the example of a new algorithm in docs/ runs."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import unison
from tests import launch
from tests.models import MLP, batch

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "unison"
ALGORITHMS = PACKAGE / "algorithms"
# Lower layers first; a module may import only from its own layer or lower ones. Every module of
# unison/ is in one (test_every_module_has_a_layer): the package's own __init__ (the public API) and
# __main__ (the command line) sit above them all.
LAYERS = [
    "runtime",
    "data",
    "ddp_keywords",
    "comm_hook",
    "memory",
    "engine",
    "sharded",
    "algorithm_hooks",
    "replica",
    "algorithms",
    "events",
    "core",
    "pickling",
    "fault",
    "debug",
    "join",
    "parallel",
    "optim",
    "sharded_checkpoint",
    "checkpoint",
    "compat",
    "integrations",
    "apps",
]
TOPS = {"unison", "unison.__main__"}
# The one import upwards: unison.algorithms.create reads the seeds' names for options from a
# table kept with the compat layers (whose business they are); the table is data importing
# nothing (test_the_upward_import_is_data), so no cycle and no behaviour comes up with it.
UPWARD = {"unison.compat.aliases"}


def _name(path: pathlib.Path) -> str:
    """The module's absolute name (a package's ``__init__.py``: the package's)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: pathlib.Path, type_checking: bool = True) -> set[str]:
    """The unison modules ``path`` imports (absolute names; ``from a import b`` is ``a.b`` where
    that is a module), those inside functions included; without ``type_checking``, not those
    under ``if TYPE_CHECKING:`` (annotations only: nothing runs them)."""
    module = _name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    if not type_checking:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skip.update(id(n) for part in node.body for n in ast.walk(part))
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.update(f"{name}.{a.name}" if f"{name}.{a.name}" in MODULES else name for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {n for n in out if n == "unison" or n.startswith("unison.")}


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else -1


def test_every_module_has_a_layer():
    """A module added outside LAYERS would escape every check below."""
    assert [m for m in MODULES if m not in TOPS and _layer(m) < 0] == []
    assert set(LAYERS) <= {m.split(".")[1] for m in MODULES if m not in TOPS}, "a layer no module is in"


def test_no_import_cycles():
    """No circle of imports, counting those inside functions (they run too, later): a module
    found on a path back to itself is named with the circle (Tarjan's strongly connected
    components of the import graph)."""
    graph = {m: {n for n in _imports(p, type_checking=False) if n in MODULES and n != m} for m, p in MODULES.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == []


def test_algorithms_reach_nothing_but_the_replica():
    for path in ALGORITHMS.rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"model\._|getattr\(model", text), path.name
        for name in _imports(path):
            assert not name.startswith(
                ("unison.parallel", "unison.optim", "unison.apps", "unison.join", "unison.checkpoint")
            ), (path.name, name)


def test_layers_import_downwards():
    for path in PACKAGE.rglob("*.py"):
        here = _layer(".".join(path.relative_to(ROOT).with_suffix("").parts))
        if here < 0:
            continue
        for name in _imports(path) - UPWARD:
            assert _layer(name) <= here, f"{path.relative_to(ROOT)} imports {name}, a layer above it"


def test_the_upward_import_is_data():
    for name in UPWARD:
        path = ROOT.joinpath(*name.split(".")).with_suffix(".py")
        tree = ast.parse(path.read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], path
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Call))], path
    init = ast.parse((PACKAGE / "compat" / "__init__.py").read_text())  # importing the table runs it
    assert not [n for n in ast.walk(init) if isinstance(n, (ast.Import, ast.ImportFrom))]


# Private attributes of torch's that unison reads on purpose, each in unison/runtime/torch_private.py and
# nowhere else (its functions say why, and test_torch_private.py fails when torch drops one).
TORCH_PRIVATE = {
    "_C",
    "_autograd",
    "_get_sequence_nr",
    "_sequence_nr",
    "_metadata",
    "_execution_engine",
    "_get_default_store",
    "_pytree",
    "_world",
    "_get_root_mesh",
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_distributed_c10d",
    "_register_process_group",
    "_unregister_process_group",
    "_set_pg_timeout",
    "_base",
}
#: What every module may read: torch's multi-tensor ops (torch.optim's own kernels), os._exit.
ANYWHERE = {"_exit"}


def _private_reaches(path: pathlib.Path) -> list[str]:
    """``x._name`` where ``_name`` is not defined in ``path`` itself, and imports of private names
    from other unison modules: a module's private names are its own."""
    text = path.read_text()
    own = set(re.findall(r"\b(?:self|cls)\.(_[a-z]\w*)", text)) | set(
        re.findall(r"^\s*(?:def|class) (_\w+)", text, re.M)
    )
    own |= set(re.findall(r"^\s*(_\w+)\s*[:=]", text, re.M)) | set(re.findall(r'"(_[a-z]\w*)"', text))
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and not node.level and path.name != "torch_private.py":
            private_module = any(s.startswith("_") and not s.startswith("__") for s in (node.module or "").split("."))
        else:
            private_module = False
        if private_module:
            out.append(f"import from {node.module}")  # torch.utils._pytree and the like
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("unison")):
            out += [f"import {a.name}" for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "torch", "dist", "os", "sys"):
                continue
            if node.attr in own or node.attr in ANYWHERE or node.attr.startswith("_foreach"):
                continue
            if node.attr in TORCH_PRIVATE and path.name == "torch_private.py":
                continue
            out.append(f"line {node.lineno}: {ast.unparse(node.value)}.{node.attr}")
    return out


def test_no_module_reaches_into_another_modules_private_names():
    reaches = {str(p.relative_to(ROOT)): r for p in PACKAGE.rglob("*.py") if (r := _private_reaches(p))}
    assert reaches == {}


#: The faces of the fault-tolerance package: the rest of unison imports these and nothing else of it.
FAULT_FACES = {"unison.fault", "unison.fault.launcher"}


def _in_fault(module: str) -> bool:
    return module == "unison.fault" or module.startswith("unison.fault.")


def test_fault_tolerance_is_reached_only_through_its_faces():
    """A change to the fault-tolerance protocol stays inside unison/fault/: outside it, modules
    import only its two faces, and the runtime and the engine nothing of it at all (they reach
    the membership through runtime/membership.py)."""
    for module, path in MODULES.items():
        if _in_fault(module):
            continue
        used = {n for n in _imports(path) if _in_fault(n)}
        assert used <= FAULT_FACES, (module, sorted(used - FAULT_FACES))
        if module.startswith(("unison.runtime", "unison.engine")):
            assert not used, (module, sorted(used))


def test_the_runtime_s_seam_is_filled_by_any_import_of_unison():
    """``unison.init()`` under a fault-tolerant launcher connects through runtime.membership, whose
    connect function the fault-tolerance package gives it at import: a process that imports only
    the runtime (which runs unison/__init__) has it."""
    code = (
        "import unison.runtime.membership as m; given = m._connect; "
        "import unison.fault.member as fm; assert given is fm.connect_with, given; print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_library_never_imports_the_apps():
    for path in PACKAGE.rglob("*.py"):
        if "apps" in path.relative_to(PACKAGE).parts or path.name == "__main__.py":  # `python -m unison` runs the app
            continue
        assert not any(n.startswith("unison.apps") for n in _imports(path)), path


def _docs_example():
    code = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "architecture.md").read_text(), re.S)[0]
    exec(compile(code, "docs/architecture.md", "exec", dont_inherit=True), {"__name__": "docs_example"})  # as a file
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model = unison.DataParallel(net, optimizer=opt, algorithm="every_so_often:period=4")
    spreads = []
    for step in range(8):
        x, y = batch(step, rank)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        spreads.append([p.detach().clone() for p in net.parameters()])
    return {"weights": spreads, "sent": model.comm_stats["bytes_total"]}


def test_the_new_algorithm_example_in_the_docs_runs():
    r0, r1 = launch.run(_docs_example, 2)
    differs = [any(not torch.equal(a, b) for a, b in zip(w0, w1)) for w0, w1 in zip(r0["weights"], r1["weights"])]
    assert differs == [True, True, True, False, True, True, True, False]  # equal right after each 4th step
    assert r0["sent"] > 0


#: The shared machinery at the top of algorithms/: everything else is an algorithm in its family's folder.
MACHINERY = {"__init__", "contract", "options", "state", "schedules", "streaming", "support"}
FAMILIES = {"gradient", "averaging"}


def test_algorithms_are_laid_out_by_family():
    top = {p.stem for p in ALGORITHMS.glob("*.py")}
    assert top <= MACHINERY, top - MACHINERY
    assert {p.name for p in ALGORITHMS.iterdir() if p.is_dir() and p.name != "__pycache__"} == FAMILIES
    for name in unison.algorithms.names():
        module = unison.algorithms.get(name).__module__.split(".")
        assert module[:2] == ["unison", "algorithms"] and module[2] in FAMILIES, (name, module)


#: The two maps of the package, each the ``text`` block after its heading.
MAPS = {"docs/architecture.md": "## Layers", "CONTRIBUTING.md": "## The layout"}
_ENTRY = re.compile(r"([\w.]+(?:/|\.py))(?:,\s*|\s|$)")


def _map(doc: str, heading: str) -> dict[tuple[str, ...], set[str]]:
    """The map's entries under ``unison/``: each path (folders end with ``/``) with the words of its
    description (its line and the lines continuing it). A line is an entry where it names files or
    folders at its parent's indentation plus two; any other line continues the entry above."""
    text = (ROOT / doc).read_text()
    block = text[text.index(heading) :]
    block = block[block.index("```text\n") + 8 :]
    block = block[: block.index("```")]
    entries: dict[tuple[str, ...], set[str]] = {}
    stack: list[tuple[int, tuple[str, ...]]] = []  # (indentation, path) of the open entries
    last: list[tuple[str, ...]] = []
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        names = []
        rest = line.strip()
        while (m := _ENTRY.match(rest)) is not None and (not names or line.strip().startswith(names[0])):
            names.append(m.group(1))
            rest = rest[m.end() :]
        child = not stack or indent <= stack[-1][0] + 2
        if names and child:
            while stack and stack[-1][0] >= indent:
                stack.pop()
            parent = stack[-1][1] if stack else ()
            last = [parent + (name,) for name in names]
            for path in last:
                entries[path] = set()
            if names[-1].endswith("/"):
                stack.append((indent, last[-1]))
            rest_words = rest
        else:
            rest_words = line
        for path in last:
            entries[path] |= set(re.findall(r"\w+", rest_words))
    return {path[1:]: words for path, words in entries.items() if path[0] == "unison/"}


def _named(module: str, entries: dict[tuple[str, ...], set[str]]) -> bool:
    """Whether the map names ``module``: as an entry (``stem.py``, or ``stem/`` for a package), or as
    a word of the deepest entry of its folders the map has."""
    parts = module.split(".")[1:]
    *folders, stem = parts if parts else ["__init__"]
    if module == "unison":
        return ("__init__.py",) in entries
    place = tuple(f"{f}/" for f in folders)
    if (*place, f"{stem}.py") in entries or (*place, f"{stem}/") in entries:
        return True
    for depth in range(len(folders), 0, -1):
        place = tuple(f"{f}/" for f in folders[:depth])
        if place in entries:
            return stem in entries[place] or (depth < len(folders) and folders[depth] in entries[place])
    return False


def test_the_maps_name_every_module_and_no_other():
    """docs/architecture.md and CONTRIBUTING.md: a module added, moved or removed without them fails."""
    for doc, heading in MAPS.items():
        entries = _map(doc, heading)
        assert [m for m in sorted(MODULES) if m != "unison.__main__" and not _named(m, entries)] == [], doc
        on_disk = {tuple(p.relative_to(PACKAGE).parts) for p in PACKAGE.rglob("*.py")}
        folders = {tuple(p.relative_to(PACKAGE).parts) for p in PACKAGE.rglob("*") if p.is_dir()}
        stale = []
        for path in entries:
            there = on_disk if path and path[-1].endswith(".py") else folders
            if path and tuple(p.rstrip("/") for p in path) not in there:
                stale.append("/".join(path))
        assert stale == [], f"{doc} names what is not there"


#: Constructors wider than ``WIDEST`` arguments that keep another system's contract.
CONTRACTS = {
    "DataParallel": "torch DDP's constructor",
    "Keywords": "torch DDP's keywords, one field each",
    "DASO": "HeAT's DASO",
    "UnisonStrategy": "Lightning's DDPStrategy",
}
#: Constructors not grouped yet, at their width today: they may narrow, never widen, and no new one joins.
NOT_YET_GROUPED = {
    "Core": 12,
    "Topology": 11,
    "Settings": 13,
    "Worker": 21,
    "TrainConfig": 11,
    "WorkerConfig": 18,
    "WorkerResult": 12,
    "BenchConfig": 22,
}
WIDEST = 10


def _widths() -> dict[str, int]:
    """Each class's constructor width: ``__init__``'s arguments, or a dataclass's fields (of
    classes of one name, the widest)."""
    found: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            names = {ast.unparse(d).split("(")[0].rsplit(".", 1)[-1] for d in node.decorator_list}
            widths = [sum(isinstance(b, ast.AnnAssign) for b in node.body)] if "dataclass" in names else []
            widths += [
                len(b.args.args) - 1 + len(b.args.kwonlyargs)
                for b in node.body
                if isinstance(b, ast.FunctionDef) and b.name == "__init__"
            ]
            found[node.name] = max([found.get(node.name, 0), *widths])
    return found


def test_no_constructor_takes_more_than_about_ten_arguments():
    """Grouped by role instead (the reducer's Layout, Sync, Callbacks and Redo), except another
    system's contract; the ones not grouped yet may not widen."""
    wide = {name: n for name, n in _widths().items() if n > WIDEST and name not in CONTRACTS}
    assert {n: w for n, w in wide.items() if w > NOT_YET_GROUPED.get(n, WIDEST)} == {}
    assert wide.keys() <= NOT_YET_GROUPED.keys()
