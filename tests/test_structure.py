"""The package's structure rules, checked on its source (no TVM needed): no import cycle between tvmkv's
modules (function-level imports included), and no module using another's private names — neither
importing ``_name`` from a tvmkv module nor reading ``obj._name`` of anything but ``self`` / ``cls``
(TVM's own underscore API, e.g. ``Tensor._create_view``, and namedtuple's are listed explicitly)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tvmkv"
# Underscore attributes that are not tvmkv's private names: TVM's own API that tvmkv uses on purpose,
# and namedtuple's public methods (underscored to avoid clashing with field names).
TVM_PRIVATE_API = {"_create_view", "_expr", "_fields", "_asdict", "_replace", "_make"}


def _modules(root: Path) -> dict:
    """``{dotted name: path}`` of every module under ``root`` (packages by their ``__init__``)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _import_edges(mods: dict) -> tuple[dict, list]:
    """Import graph ``{module: {imported tvmkv modules}}`` and the private names imported."""
    edges: dict = {m: set() for m in mods}
    private = []
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != "tvmkv":
                    continue
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    edges[mod].add(full if full in mods else target)
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        private.append(f"{mod} imports {full}")
            elif isinstance(node, ast.Import):
                edges[mod].update(a.name for a in node.names if a.name in mods)
    return {m: {t for t in ts if t in mods and t != m} for m, ts in edges.items()}, private


def _cycles(edges: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    edges, _ = _import_edges(_modules(PACKAGE))
    assert len(edges) > 30  # the walk found the package
    assert _cycles(edges) == []


def test_cycle_finder_finds_a_cycle():
    """The oracle itself: a two-module cycle and a three-module cycle are reported, a chain is not."""
    edges = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(_cycles(edges)) == [["a", "b"], ["c", "d", "e"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_private_imports():
    _, private = _import_edges(_modules(PACKAGE))
    assert private == []


@pytest.mark.parametrize("tree", ["tests", "bench", "scripts"])
def test_no_private_imports_from_tvmkv_outside_the_package(tree):
    found = []
    for path in sorted((ROOT / tree).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tvmkv":
                found += [
                    f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert found == []


@pytest.mark.parametrize("tree", ["tvmkv", "tests"])
def test_no_private_attribute_of_another_object(tree):
    """``x._name`` only on ``self`` / ``cls`` (and TVM's own listed underscore API)."""
    found = []
    for path in sorted((ROOT / tree).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and node.attr not in TVM_PRIVATE_API
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert found == []
