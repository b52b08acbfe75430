"""The package's shape (issue 25), read from the source with :mod:`ast`, never by importing it.

1. No import circle among the modules of ``airflow_retention``: every ``import`` and ``from … import`` of the
   package counts, at the top of a module or inside a function (a lazy import still runs); only those under
   ``if TYPE_CHECKING:`` are left out of the graph, since they never run.
2. The stages of the core: ``airflow_retention.core.<stage>`` imports only from its own stage, earlier ones in
   :data:`STAGES`, and the shared leaves :data:`LEAVES` (``core.errors``, ``core.moved``: they import nothing
   of the package). The core never imports ``airflow`` nor the package outside the core. Here imports under
   ``if TYPE_CHECKING:`` count too: a type named from a later stage is still a dependency. ``core/__init__.py``
   is the public core API (docs/api.md): it stands above every stage and may name any of them, and no module
   of the core imports it but the deprecated forwarding modules (:data:`DEPRECATED`), which import only it and
   ``core.moved``, and which nothing in the package imports.
3. No module over :data:`MAX_MODULE_LINES` physical lines.
4. The entry points read top-down: ``core/running/engine.py``'s ``run_chunk``, every public top-level
   function of ``core/planning/planner.py``, the walkers' plan functions and the partition survey under
   :data:`MAX_FUNCTION_LINES` lines (``def`` to its last line).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

PACKAGE = "airflow_retention"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
CORE = f"{PACKAGE}.core"
LEAVES = (f"{CORE}.errors", f"{CORE}.moved")
# 0.1.0's module paths, kept for one release as forwarding modules (airflow_retention/core/moved.py).
DEPRECATED = tuple(f"{CORE}.{name}" for name in ("planner", "engine", "verify", "cutoff", "catalog"))
STAGES = ("policy", "sql", "db", "ledger", "planning", "running")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 100
# None: every public function. The walkers' plan functions and the partition survey are the planner's too.
ENTRY_POINTS = {
    "running/engine.py": {"run_chunk"},
    "planning/planner.py": None,
    "planning/walkers/blocks.py": {"plan_blocks"},
    "planning/walkers/keys.py": {"plan_keys"},
    "planning/walkers/partitions.py": {"plan_partitioned"},
    "planning/partitions.py": {"survey"},
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    line: int
    target: str  # a module of the package when the statement names one, else what it names
    statement: str
    type_only: bool  # under ``if TYPE_CHECKING:``

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: {self.statement}"


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _import_nodes(node: ast.AST, type_only: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node, type_only
    elif isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
        for child in node.body:
            yield from _import_nodes(child, True)
        for child in node.orelse:
            yield from _import_nodes(child, type_only)
    else:
        for child in ast.iter_child_nodes(node):
            yield from _import_nodes(child, type_only)


def imports_of(name: str, source: str, is_package: bool, known: set[str] | dict[str, Path]) -> list[Import]:
    """The imports of one module, relative ones resolved; ``from a import b`` names ``a.b`` when that is a module."""
    found = []
    for node, type_only in _import_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join([*parts[: len(parts) - node.level + 1], *([node.module] if node.module else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in dict.fromkeys(targets):
            found.append(Import(name, node.lineno, target, ast.unparse(node), type_only))
    return found


@cache
def all_imports() -> list[Import]:
    found = []
    for name, path in modules().items():
        found += imports_of(name, path.read_text(), path.name == "__init__.py", modules())
    return found


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of the graph that hold a cycle (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> Iterator[str]:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        return iter(sorted(graph.get(node, ())))

    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, visit(root))]
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    work.append((child, visit(child)))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = [stack.pop()]
                    while component[-1] != node:
                        component.append(stack.pop())
                    on_stack.difference_update(component)
                    if len(component) > 1 or node in graph.get(node, ()):
                        cycles.append(sorted(component))
    return sorted(cycles)


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": {"e"}, "e": set(), "f": {"f"}, "g": {"h"}, "h": {"d"}}
    assert find_cycles(graph) == [["a", "b", "c"], ["f"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_imports_are_resolved_wherever_they_are() -> None:
    source = (
        "from typing import TYPE_CHECKING\nfrom airflow_retention.core.db import dbapi, transaction\n"
        "from ..ledger import ledger\nif TYPE_CHECKING:\n    from .x import Y\ndef f():\n    import airflow.sdk\n"
    )
    known = {"airflow_retention.core.db.dbapi", "airflow_retention.core.ledger.ledger"}
    found = imports_of("airflow_retention.core.running.z", source, False, known)
    assert [(i.line, i.target, i.type_only) for i in found] == [
        (1, "typing", False),
        (2, "airflow_retention.core.db.dbapi", False),
        (2, "airflow_retention.core.db", False),
        (3, "airflow_retention.core.ledger.ledger", False),
        (5, "airflow_retention.core.running.x", True),
        (7, "airflow.sdk", False),
    ]


def test_no_import_circle() -> None:
    graph: dict[str, set[str]] = {name: set() for name in modules()}
    for found in all_imports():
        if found.target in graph and not found.type_only:
            graph[found.module].add(found.target)
    cycles = find_cycles(graph)
    report = [
        f"{', '.join(cycle)} import one another in a circle:\n    "
        + "\n    ".join(str(i) for i in all_imports() if {i.module, i.target} <= set(cycle) and not i.type_only)
        for cycle in cycles
    ]
    assert not cycles, f"{len(cycles)} import circle(s):\n" + "\n".join(report)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def _stage(module: str) -> int:
    """The module's stage; -1 for the core's leaves (``core/__init__.py``, ``core/errors.py``) and strays."""
    part = module.removeprefix(f"{CORE}.").split(".")[0]
    return STAGES.index(part) if _within(module, CORE) and part in STAGES else -1


def test_the_core_imports_only_earlier_stages_and_never_airflow() -> None:
    strays = [m for m in modules() if _within(m, CORE) and m not in (CORE, *LEAVES, *DEPRECATED) and _stage(m) < 0]
    wrong = [f"{m}: in the core but in none of its stages" for m in strays]
    for found in all_imports():
        if found.target in DEPRECATED and found.module not in DEPRECATED:
            wrong.append(f"{found}  (a deprecated path: import from its new module)")
        if found.target == CORE and _within(found.module, CORE) and found.module not in DEPRECATED:
            wrong.append(f"{found}  (the public core API is for users: the core imports its modules)")
    for found in (i for i in all_imports() if _within(i.module, CORE)):
        own, theirs = _stage(found.module), _stage(found.target)
        if _within(found.target, "airflow"):
            wrong.append(f"{found}  (the core is Airflow-free)")
        elif _within(found.target, PACKAGE) and not _within(found.target, CORE):
            wrong.append(f"{found}  (the core imports nothing of the package outside the core)")
        elif found.module == CORE:
            continue  # the public core API names every stage
        elif found.module in DEPRECATED:
            if _within(found.target, CORE) and found.target not in (CORE, f"{CORE}.moved"):
                wrong.append(f"{found}  (a deprecated path forwards through core.moved only)")
        elif _within(found.target, CORE) and found.target not in (CORE, *LEAVES) and (own < 0 or theirs > own):
            may = ", ".join(STAGES[: own + 1]) if own >= 0 else "nothing of the core"
            wrong.append(f"{found}  ({STAGES[own] if own >= 0 else 'a leaf'} may import only {may} and errors)")
    assert not wrong, f"{len(wrong)} import(s) against the stage order {' -> '.join(STAGES)}:\n" + "\n".join(wrong)


def test_no_module_over_the_line_limit() -> None:
    sizes = {path.relative_to(ROOT.parent): len(path.read_text().splitlines()) for path in modules().values()}
    over = [
        f"{path}: {n} lines" for path, n in sorted(sizes.items(), key=lambda item: -item[1]) if n > MAX_MODULE_LINES
    ]
    assert not over, f"{len(over)} module(s) over {MAX_MODULE_LINES} lines:\n" + "\n".join(over)


def test_entry_points_read_top_down() -> None:
    long, missing = [], []
    for relative, names in ENTRY_POINTS.items():
        path = ROOT / "core" / relative
        functions = {
            node.name: node
            for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        wanted = names if names is not None else {n for n in functions if not n.startswith("_")}
        missing += [f"{relative}: no top-level function {name}" for name in sorted(wanted - functions.keys())]
        for name in sorted(wanted & functions.keys()):
            node = functions[name]
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            if size >= MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {name}: {size} lines")
    assert not missing, "\n".join(missing)
    assert not long, f"{len(long)} entry point(s) of {MAX_FUNCTION_LINES} lines or more:\n" + "\n".join(long)
