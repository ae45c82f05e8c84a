"""The package's shape: imports point one way only, and every target is one registered module.

Imports are read from the source (those inside functions too, since a deferred import is still a
dependency), so a new cycle fails here before it can fail at import time in some order.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import onnxport
import onnxport.targets as targets_pkg
from onnxport.targets import REGISTRY, TARGETS, Target, get_target

ROOT = Path(onnxport.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Each onnxport module and the onnxport modules it imports, wherever in the file."""
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                # `from . import _io` imports the module _io; `from .. import __version__` the package
                for alias in node.names:
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base)
                if node.module:
                    found.add(base)
        edges[name] = {m for m in found if m in files and m != name}
    return edges


def _unit(module: str, depth: int) -> str:
    return ".".join(module.split(".")[:depth])


def _cycles(edges: dict[str, set[str]], depth: int) -> list[list[str]]:
    """Strongly connected groups of more than one unit, units being modules cut to ``depth`` parts.
    The package's ``__init__`` (the lazy public names) is left out: it sits above everything."""
    graph: dict[str, set[str]] = {}
    for source, targets in edges.items():
        a = _unit(source, depth)
        for target in targets:
            b = _unit(target, depth)
            if a != b and "onnxport" not in (a, b):
                graph.setdefault(a, set()).add(b)

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reached = {unit: reach(unit) for unit in graph}
    groups = {frozenset({u} | {v for v in reached[u] if u in reached.get(v, ())}) for u in graph}
    return sorted(sorted(g) for g in groups if len(g) > 1)


@pytest.mark.parametrize("depth", [2, 3], ids=["packages", "modules"])
def test_no_import_cycle(depth):
    cycles = _cycles(_imports(), depth)
    assert not cycles, f"modules that import each other (directly or through others): {cycles}"


def test_only_the_front_modules_import_the_package_root():
    # the root imports every layer (its lazy public names): a layer that reads it points back up
    front = {"onnxport.cli", "onnxport.demo", "onnxport.__main__"}
    upward = sorted(m for m, targets in _imports().items() if "onnxport" in targets and m not in front | {"onnxport"})
    assert not upward, f"modules that import the package root: {upward}"


def test_the_cycle_finder_finds_a_cycle():
    edges = {"onnxport.a.x": {"onnxport.b.y"}, "onnxport.b.y": {"onnxport.c"}, "onnxport.c": {"onnxport.a.x"},
             "onnxport.d": {"onnxport.c"}}
    assert _cycles(edges, 2) == [["onnxport.a", "onnxport.b", "onnxport.c"]]
    assert _cycles({"onnxport.a": {"onnxport.b"}}, 2) == []


def test_targets_import_nothing_above_errors():
    low = {"onnxport.errors", "onnxport._core.cpu"}
    for module, imported in _imports().items():
        if module.startswith("onnxport.targets"):
            outside = {m for m in imported if not m.startswith("onnxport.targets")} - low
            assert not outside, f"{module} imports {outside}: targets must stay readable from every layer"


def test_every_target_module_is_registered_and_whole():
    modules = [m.name for m in pkgutil.iter_modules(targets_pkg.__path__) if not m.name.startswith("_")]
    for name in modules:
        target = importlib.import_module(f"onnxport.targets.{name}").TARGET
        assert isinstance(target, Target) and target.name == name
        assert get_target(None if name == "default" else name) is target
    assert set(TARGETS) == set(modules) - {"default"} == set(REGISTRY)


def _from_imports(path: Path, package: str):
    """(line, module, name) of every ``from … import name`` in a file, relative ones resolved."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                yield node.lineno, base, alias.name


def _private_parts(dotted: str) -> list[str]:
    return [part for part in dotted.split(".") if part.startswith("_") and not part.startswith("__")]


def test_no_package_reaches_into_another_packages_private_names():
    # the private core (onnxport._core.io, _ir, _axes, …) is every package's to use; a private name or
    # module inside another package (targets._base, quantizer._capture) is not
    found = []
    for path in ROOT.rglob("*.py"):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        mine = ".".join(name.split(".")[:2])
        for line, module, imported in _from_imports(path, package):
            if not module.startswith("onnxport.") or ".".join(module.split(".")[:2]) == mine:
                continue
            if _private_parts(".".join([*module.split(".")[2:], imported])):
                found.append(f"{path.relative_to(ROOT.parent)}:{line} {module}.{imported}")
    assert not found, found


def test_the_benchmarks_use_public_names_only():
    found = []
    for path in (ROOT.parent / "bench").rglob("*.py"):
        for line, module, imported in _from_imports(path, "bench"):
            if module.startswith("onnxport") and _private_parts(f"{module}.{imported}"):
                found.append(f"{path.name}:{line} {module}.{imported}")
        found += [f"{path.name}: import {a.name}" for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.Import) for a in node.names
                  if a.name.startswith("onnxport") and _private_parts(a.name)]
        # and the scripts a benchmark runs in a child process, which live in its strings
        found += [f"{path.name}: {m.group(0)}" for m in re.finditer(r"from (onnxport[\w.]*) import ([^\n]+)", path.read_text())
                  if _private_parts(m.group(1)) or any(_private_parts(n.strip()) for n in m.group(2).split(","))]
    assert not found, found


def test_one_module_stages_files_and_builds_pipelines():
    writers = sorted(_module_name(p) for p in ROOT.rglob("*.py")
                     if any(f"{name}(" in p.read_text() for name in ("staged_output", "staged_folder", "Pipeline")))
    # the core's io defines the staging; the engine is the one caller (a folder's exporter asks it)
    assert writers == ["onnxport._core.io", "onnxport.engine"], writers
