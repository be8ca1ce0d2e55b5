"""The house's floors held to the code: every import of every Python file (read with ``ast``: imports inside
functions and under ``TYPE_CHECKING`` count too) goes down the floors, never up nor sideways into another folder of
the same floor, and no module imports itself back through others.

The floors, bottom to top (``../shared/DESIGN.md``, "The direction of dependencies"): ``ipc/`` (the wire and the
tensor plane), ``models/`` (the networks; they speak the wire's values), ``runtime/`` (sans-io rank-0 and router
logic), ``ranks/`` (the I/O shell of each rank), ``router/`` and ``web/`` (the router's and the gateway's programs),
``scripts/`` and ``launch.py`` (commands), ``tests/``. A module may import anything of its own folder, as long as no
circle closes."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FLOORS = {"configs": 0, "ipc": 1, "models": 2, "runtime": 3, "ranks": 4, "router": 5, "web": 5, "scripts": 6,
          "launch": 6, "tests": 7}  # fmt: skip; configs: the presets' package (data, imports nothing)
NOT_SOURCE = {"out", "build", "logs"}  # what runs leave behind (.gitignore), never imported

Import = tuple[str, str, int]  # (importing module, imported module, line)


def source_files() -> dict[str, Path]:
    """Every Python file of the tree by its module name (``runtime.core``; a package by its folder's name)."""
    modules = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if any(part.startswith(".") for part in parts) or parts[0] in NOT_SOURCE:
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> Iterator[Import]:
    """The modules of this tree that ``name`` imports, wherever in the file the import stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per dot after the first
                above = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
                base = ".".join([*above, base] if base else above)
            # ``from a import b`` names the module a.b where there is one, else a name defined in a
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target in modules and target != name:
                yield name, target, node.lineno


@functools.cache  # the tree is read once for all the tests
def all_imports() -> list[Import]:
    modules = source_files()
    return list(dict.fromkeys(edge for name, path in modules.items() for edge in imports_of(name, path, modules)))


def folder(module: str) -> str:
    return module.split(".")[0]


def circles(edges: list[Import]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for source, target, _ in edges:
        graph.setdefault(source, set()).add(target)
        graph.setdefault(target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_the_import_reader_sees_imports_in_functions_and_under_type_checking() -> None:
    edges = {(source, target) for source, target, _ in all_imports()}
    assert ("runtime.core", "ipc.protocol") in edges  # at the top of the file
    assert ("ranks.backend", "models.lingbot") in edges  # inside build_lingbot
    assert ("ipc.tensor_plane", "ipc.streams") in edges and len(edges) > 500


def test_every_folder_of_source_stands_on_a_floor() -> None:
    unplaced = sorted({folder(name) for name in source_files()} - set(FLOORS))
    assert unplaced == [], f"place these in FLOORS (tests/test_layers.py) before importing them: {unplaced}"


def test_no_module_imports_itself_back_through_others() -> None:
    edges = all_imports()
    found = circles(edges)
    ties = [f"{s} -> {t} (line {line})" for group in found for s, t, line in edges if s in group and t in group]
    assert found == [], f"import circles: {found}; their imports: {ties}"


def test_every_import_goes_down_the_floors() -> None:
    wrong = [f"{source}:{line} imports {target} (floor {FLOORS[folder(source)]} -> {FLOORS[folder(target)]})"
             for source, target, line in all_imports()
             if folder(source) != folder(target) and FLOORS[folder(target)] >= FLOORS[folder(source)]]  # fmt: skip
    assert wrong == [], "imports up the floors or sideways:\n" + "\n".join(wrong)
