"""The packages' dependency rules, read from the source with `ast` so the structure cannot silently erode.

foundation (artifact) <- models <- exporters / runners <- toolkit

Every import counts, at module level or inside a function, so a circle cannot hide in a function body.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("artifact", "models", "exporters", "runners", "toolkit")
FOUNDATION = "artifact"
# What each package may import from the others (itself always).
ALLOWED = {
    "artifact": set(),
    "models": {"artifact"},
    "exporters": {"artifact", "models"},
    "runners": {"artifact", "models", "exporters"},
    "toolkit": {"artifact", "models", "exporters", "runners"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The project modules a file imports anywhere in it; `from pkg import name` counts pkg.name when that
    is a module, else pkg."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            # the longest known module that is the name or a prefix of it
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported_modules(path, set(known)) - {name} for name, path in known.items()}


def test_the_source_is_found():
    graph = import_graph()
    assert {name.split(".")[0] for name in graph} == set(PACKAGES)
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100


def test_no_layer_imports_upwards():
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in targets
        if target.split(".")[0] != module.split(".")[0] and target.split(".")[0] not in ALLOWED[module.split(".")[0]]
    )
    assert not wrong, "\n".join(wrong)


def test_the_foundation_imports_none_of_the_others():
    graph = import_graph()
    outside = sorted(
        f"{m} imports {t}"
        for m, ts in graph.items()
        if m.split(".")[0] == FOUNDATION
        for t in ts
        if t.split(".")[0] != FOUNDATION
    )
    assert not outside, "\n".join(outside)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_there_is_no_import_cycle_between_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


@pytest.mark.parametrize(
    "graph,expected",
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ],
)
def test_the_cycle_finder_finds_cycles(graph, expected):
    assert find_cycle(graph) == expected


def test_function_level_imports_count(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("import os\n\ndef f():\n    from runners.eager import EagerRunner\n    import toolkit.cli\n")
    assert imported_modules(source, {"runners.eager", "runners", "toolkit.cli", "toolkit"}) == {
        "runners.eager",
        "toolkit.cli",
    }
