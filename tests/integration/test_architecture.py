"""The architecture holds: algorithms see only the Replica, the layers import downwards,
algorithms are laid out by family, and the example of a new algorithm in docs/ runs."""

from __future__ import annotations

import ast
import pathlib
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F

import unison
from tests import launch
from tests.models import MLP, batch

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "unison"
ALGORITHMS = PACKAGE / "algorithms"
# Lower layers first; a module may import only from its own layer or lower ones.
LAYERS = [
    "runtime",
    "ddp_keywords",
    "comm_hook",
    "memory",
    "engine",
    "hooks",
    "replica",
    "algorithms",
    "events",
    "core",
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
# The one import upwards: unison.algorithms.create reads the seeds' names for options from a
# table kept with the compat layers (whose business they are); the table is data importing
# nothing (test_the_upward_import_is_data), so no cycle and no behaviour comes up with it.
UPWARD = {"unison.compat.aliases"}


def _imports(path: pathlib.Path) -> set[str]:
    """The unison modules ``path`` imports (absolute names)."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.update(f"{name}.{a.name}" if not node.module else name for a in node.names)  # `from . import x`: x
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {n for n in out if n == "unison" or n.startswith("unison.")}


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else -1


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


# Private attributes of torch's that unison reads on purpose (state-dict metadata, tensor versions,
# c10d's _world: the count that names unnamed groups, put back after a failed regroup, autograd's
# sequence numbers, which order a forward's ops for nonblocking's check, DeviceMesh's root mesh,
# which says whether FSDP2's mesh and device_mesh are dimensions of one mesh, an optimizer's step
# hooks, held off while torch.distributed.checkpoint's state-dict helpers step it to make its state,
# c10d's group registry, out of which a node's group is taken around a regroup and put back, a
# view's base, which says whether same-shaped matrices are evenly spaced views of one buffer (one
# batched product for them all in PowerSGD's whole schedule), ...).
TORCH_PRIVATE = {
    "_C",
    "_autograd",
    "_get_sequence_nr",
    "_sequence_nr",
    "_metadata",
    "_version",
    "_execution_engine",
    "_get_default_store",
    "_exit",
    "_pytree",
    "_foreach",
    "_world",
    "_get_root_mesh",
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_distributed_c10d",
    "_register_process_group",
    "_unregister_process_group",
    "_base",
}


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
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("unison")):
            out += [f"import {a.name}" for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "torch", "dist", "os", "sys"):
                continue
            if node.attr in own or node.attr in TORCH_PRIVATE or node.attr.startswith("_foreach"):
                continue
            out.append(f"line {node.lineno}: {ast.unparse(node.value)}.{node.attr}")
    return out


def test_no_module_reaches_into_another_modules_private_names():
    reaches = {str(p.relative_to(ROOT)): r for p in PACKAGE.rglob("*.py") if (r := _private_reaches(p))}
    assert reaches == {}


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
MACHINERY = {"__init__", "contract", "options", "state", "schedules", "streaming", "averaging_thread"}
FAMILIES = {"gradient", "averaging"}


def test_algorithms_are_laid_out_by_family():
    top = {p.stem for p in ALGORITHMS.glob("*.py")}
    assert top <= MACHINERY, top - MACHINERY
    assert {p.name for p in ALGORITHMS.iterdir() if p.is_dir() and p.name != "__pycache__"} == FAMILIES
    for name in unison.algorithms.names():
        module = unison.algorithms.get(name).__module__.split(".")
        assert module[:2] == ["unison", "algorithms"] and module[2] in FAMILIES, (name, module)
