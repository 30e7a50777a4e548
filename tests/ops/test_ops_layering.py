"""The package's import graph, read from the sources: no import circle anywhere in ``hf_qsa_cache``; the ops (the
bottom layer) import nothing of the package outside ``hf_qsa_cache.ops``; every Triton module has a specification
module of its op's name and imports nothing from it; and no module keeps a fusion switch of its own (they live in
the registry, `hf_qsa_cache.ops.fusions`)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "hf_qsa_cache"
ROOT = Path(__file__).resolve().parents[2]
OPS = f"{PACKAGE}.ops"


def _modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its ``__init__``)."""
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source (a function's lazy import too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # "from x import y": y itself where it is a module, else x.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = _modules(root)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def layering_errors(graph: dict[str, set[str]]) -> list[str]:
    """What breaks the ops' rules: an import from outside the ops, a Triton module importing its dispatch module,
    a Triton module without a specification module of its op's name."""
    errors = []
    for name, targets in sorted(graph.items()):
        if name != OPS and not name.startswith(OPS + "."):
            continue
        errors += [f"{name} imports {t} (outside {OPS})" for t in sorted(targets)
                   if t != OPS and not t.startswith(OPS + ".")]
        if name.endswith("_triton"):
            op = name.removesuffix("_triton")
            if op not in graph and f"{op}_ref" not in graph:
                errors.append(f"{name} has no specification module {op} or {op}_ref")
            if op in targets:
                errors.append(f"{name} imports its dispatch module {op}")
    return errors


def fusion_globals(root: Path = ROOT) -> list[str]:
    """Module-level names ``FUSED_*`` (a switch kept outside the registry) in the package and the models."""
    found = []
    for path in [*(root / PACKAGE).rglob("*.py"), *(root / "modeling").rglob("*.py")]:
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            found += [f"{path.relative_to(root)}: {t.id}" for t in targets
                      if isinstance(t, ast.Name) and t.id.startswith("FUSED_")]
    return found


def test_the_package_has_no_import_circle():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()))


def test_the_ops_import_only_the_ops_and_kernels_only_their_helpers():
    assert layering_errors(import_graph()) == []


def test_no_module_keeps_a_fusion_switch():
    assert fusion_globals() == []


def test_the_checks_see_what_they_look_for():
    """The checks themselves on small graphs: a circle through a lazy import, an op reaching up, a kernel reaching
    its dispatch module, a kernel without a specification."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"b"}}) is None
    graph = {OPS: set(), f"{OPS}.x": {f"{PACKAGE}.cache"}, f"{OPS}.x_triton": {f"{OPS}.x"},
             f"{OPS}.y_triton": set(), f"{PACKAGE}.cache": {f"{OPS}.x"}}
    assert layering_errors(graph) == [f"{OPS}.x imports {PACKAGE}.cache (outside {OPS})",
                                      f"{OPS}.x_triton imports its dispatch module {OPS}.x",
                                      f"{OPS}.y_triton has no specification module {OPS}.y or {OPS}.y_ref"]
    assert find_cycle(graph) == [f"{PACKAGE}.cache", f"{OPS}.x", f"{PACKAGE}.cache"]
