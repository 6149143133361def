"""The module graph of kvsieve's packages, read from their source: every module, every import
edge, the import cycles. tests/test_layering.py checks it against docs/architecture.md's layer
table; tests/test_house.py counts on it.

Edges are read from the source: `import`, `from ... import` (to the submodule when it is one),
relative imports resolved, imports under TYPE_CHECKING, and `importlib.import_module` /
`__import__` / `find_spec` of literal names (or of an item of a module-level dict of literal
names: an edge to each of them).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvstore", "radix", "importance", "engine_adapter", "bench")
DYNAMIC = {"import_module", "__import__", "find_spec"}


class Edge(NamedTuple):
    """`source` (a module) imports `target` (a dotted name; "?" when computed) at `line`."""

    source: str
    target: str
    line: int


# -- the edges --------------------------------------------------------------------------------------


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the packages under `root`, by dotted name. No file is skipped."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def edges_of(module: str, path: Path, known: set[str]) -> list[Edge]:
    """Every import edge of one module (see module docstring)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    constants = _string_constants(tree)
    tables = _string_tables(tree)
    edges: list[Edge] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            edges += [Edge(module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, package)
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                edges.append(Edge(module, sub if sub in known else base, node.lineno))
        elif isinstance(node, ast.Call) and _called_name(node.func) in DYNAMIC and node.args:
            listed = _table_values(node.args[0], tables)
            if listed is not None:  # import_module(TABLE[key]): any of the table's modules
                edges += [Edge(module, name, node.lineno) for name in listed]
            else:
                target = _literal_name(node, constants, package)
                edges.append(Edge(module, target or "?", node.lineno))
    return edges


def _resolve(name: str, level: int, package: str) -> str:
    if level == 0:
        return name
    base = package.split(".")[: len(package.split(".")) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _called_name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level `NAME = "literal"` assignments."""
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Constant):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                    out[target.id] = node.value.value
    return out


def _string_tables(tree: ast.Module) -> dict[str, list[str]]:
    """Module-level dicts whose values are all string literals (`BENCHMARKS = {"store": "bench..."}`)."""
    out: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Dict):
            values = node.value.values
            literal = all(isinstance(v, ast.Constant) and isinstance(v.value, str) for v in values)
            if not (values and literal):  # `{}` names nothing: a lookup in it stays computed
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    out[target.id] = [v.value for v in values if isinstance(v, ast.Constant)]
    return out


def _table_values(arg: ast.expr, tables: dict[str, list[str]]) -> list[str] | None:
    """The modules `TABLE[key]` may name, when `arg` is that and TABLE is a table of literals."""
    if isinstance(arg, ast.Subscript) and isinstance(arg.value, ast.Name) and arg.value.id in tables:
        return tables[arg.value.id]
    return None


def _literal_name(call: ast.Call, constants: dict[str, str], package: str) -> str | None:
    """The module a dynamic import names, if the source says it; None when it is computed."""
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        name = arg.value
    elif isinstance(arg, ast.Name) and arg.id in constants:
        name = constants[arg.id]
    elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        name = str(arg.values[0].value).rpartition(".")[0]  # f"bench.{name}_bench" -> bench
        if not name:
            return None
    else:
        return None
    if name.startswith("."):  # import_module(".x", "pkg")
        anchor = call.args[1] if len(call.args) > 1 else None
        anchor_name = anchor.value if isinstance(anchor, ast.Constant) else package
        level = len(name) - len(name.lstrip("."))
        return _resolve(name.lstrip("."), level, str(anchor_name))
    return name


# -- cycles -------------------------------------------------------------------------------------------


def import_cycles(root: Path, package: str = "kvstore") -> list[list[str]]:
    """Every strongly connected group of two or more modules of `package`, each as a sorted list
    (a module importing itself counts too). Edges to a package's `__init__` count as edges to it."""
    found = modules(root)
    known = set(found)
    graph: dict[str, set[str]] = {m: set() for m in found if m == package or m.startswith(package + ".")}
    for module in graph:
        for edge in edges_of(module, found[module], known):
            target = edge.target
            while target not in graph and "." in target:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target in graph:
                graph[module].add(target)
    return [sorted(c) for c in _strongly_connected(graph) if len(c) > 1 or c[0] in graph[c[0]]]


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the graph has a few hundred nodes)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    groups.append(group)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return groups
