"""The package's import graph has no cycle, lazy imports inside functions included: every module can be
read after the modules it imports (the distributed seam's backends import its interface, ``_seam``,
and the one factory, ``sync.sync_for``, imports the backends; none imports ``sync`` back)."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

import gradaccum

PACKAGE = Path(gradaccum.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> Dict[str, Set[str]]:
    """Each module of the package -> the package's modules it imports anywhere in its text."""
    paths = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    graph: Dict[str, Set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in paths}
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for a in node.names:  # `from . import sync` names a module; `from .sync import X` its module
                    deps.add(f"{target}.{a.name}" if f"{target}.{a.name}" in paths else target)
        graph[name] = {d for d in deps if d in paths and d != name}
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert {"gradaccum._seam", "gradaccum._deepspeed"} <= graph["gradaccum.sync"]  # the graph sees the seam
    assert "gradaccum.sync" not in graph["gradaccum._deepspeed"]
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def _backends(cls: type) -> List[type]:
    return [cls] + [b for sub in cls.__subclasses__() for b in _backends(sub)]


def test_a_backend_that_steps_or_backpropagates_itself_says_so():
    """The window and the boundary read what a seam declares, not which methods it overrides: a backend with
    its own step() must declare owns_step (else the boundary would call the optimizer's step and skip it),
    and one with its own backward() is the only kind that does (the base's is torch.Tensor.backward itself)."""
    import torch

    from gradaccum import sync  # noqa: F401 - registers DDPSync, FSDP2Sync
    from gradaccum._deepspeed import DeepSpeedSync
    from gradaccum._seam import GradSync

    backends = [b for b in _backends(GradSync) if b.__module__.startswith("gradaccum.")]  # not a test's own fake
    assert DeepSpeedSync in backends and len(backends) >= 4, backends
    assert GradSync.backward is torch.Tensor.backward
    for backend in backends:
        own_step = backend.step is not GradSync.step
        own_backward = backend.backward is not GradSync.backward
        name = backend.__name__
        assert own_step == backend.owns_step, f"{name}: step() overridden {own_step}, owns_step {backend.owns_step}"
        assert not own_backward or backend.owns_step, f"{name} backpropagates itself without owning the step"
