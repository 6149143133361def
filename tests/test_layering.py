"""Every import edge of every module follows the layer table of docs/architecture.md; kvstore's
and bench's modules form no cycle; every name is imported from the module that defines it.

The table is parsed from the page, so page and test cannot drift. The edges and the cycles
are read from the source by tests/import_graph.py.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import NamedTuple

import pytest
from import_graph import PACKAGES, ROOT, Edge, edges_of, import_cycles, modules

HEAVY = {"torch", "transformers", "grpc", "lmdb", "redis", "accelerate"}
FACADES = ("kvstore", "kvstore.store", "kvstore.client")  # package __init__s that re-export their subtree


class Unit(NamedTuple):
    """One row of the layer table."""

    name: str
    layer: int
    may_import: frozenset[str]
    third_party: frozenset[str] | None  # None: any
    third_party_banned: frozenset[str]
    composition_root: bool


# -- the table ------------------------------------------------------------------------------------


def layer_table(doc: Path = ROOT / "docs" / "architecture.md") -> dict[str, Unit]:
    """The rows under "## Layer table" in docs/architecture.md, by unit name."""
    section = doc.read_text().split("## Layer table", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # after header and rule
    units: dict[str, Unit] = {}
    for row in rows:
        layer, unit, may_import, third = (cell.strip() for cell in row.strip("|").split("|"))
        (name,) = _ticked(unit)
        banned = frozenset(_ticked(third)) if third.startswith("any except") else frozenset()
        units[name] = Unit(
            name, int(layer), frozenset(_ticked(may_import.split("(")[0])),
            None if third.startswith("any") else frozenset(_ticked(third)), banned,
            "composition root" in may_import,
        )  # fmt: skip
    return units


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([\w.]+)`", cell)


def unit_of(module: str, units: dict[str, Unit]) -> Unit | None:
    """The row whose unit is the longest prefix of `module` (None: not one of ours)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in units:
            return units[".".join(parts[:n])]
    return None


# -- the check --------------------------------------------------------------------------------------


def violations(root: Path, units: dict[str, Unit]) -> list[str]:
    """Every edge of every module under `root` that the table does not allow, as readable lines."""
    found = modules(root)
    known = set(found)
    bad: list[str] = []
    for module, path in found.items():
        unit = unit_of(module, units)
        if unit is None:
            bad.append(f"{module}: in no row of the layer table")
            continue
        for edge in edges_of(module, path, known):
            problem = _problem(edge, unit, units)
            if problem:
                bad.append(f"{path.relative_to(root)}:{edge.line}: {module} -> {edge.target}: {problem}")
    return bad


def _problem(edge: Edge, unit: Unit, units: dict[str, Unit]) -> str:
    if edge.target == "?":
        return "imports a computed name (commands of other packages come from entry points)"
    target = unit_of(edge.target, units)
    if target is None:
        return _third_party_problem(edge.target.split(".")[0], unit)
    if target.name == unit.name or target.name in unit.may_import:
        return ""
    return f"{unit.name} (layer {unit.layer}) may not import {target.name} (layer {target.layer})"


def _third_party_problem(top: str, unit: Unit) -> str:
    if top in sys.stdlib_module_names or top == "__future__":
        return ""
    if top in unit.third_party_banned:
        return f"{unit.name} may not import {top}"
    if unit.third_party is not None and not any(
        top == allowed.split(".")[0] for allowed in unit.third_party
    ):  # fmt: skip
        return f"{unit.name} may import only {sorted(unit.third_party)} outside the standard library"
    return ""


# -- tests ------------------------------------------------------------------------------------------


def test_every_import_edge_follows_the_layer_table() -> None:
    bad = violations(ROOT, layer_table())
    assert not bad, "\n".join(bad)


def test_the_table_covers_every_package_and_points_downward() -> None:
    units = layer_table()
    assert set(PACKAGES) <= set(units)
    for unit in units.values():
        for other in unit.may_import:
            assert other in units, f"{unit.name} names {other}, which has no row"
            assert units[other].layer < unit.layer, f"{unit.name} may import {other}, not below it"
    roots = [u for u in units.values() if u.composition_root]
    assert [u.name for u in roots] == ["kvstore.cli.main"]
    assert not [u.name for u in units.values() if "kvstore.cli.main" in u.may_import]  # nothing imports it


def test_command_plugins_are_declared_entry_points_above_kvstore() -> None:
    units = layer_table()
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    plugins = declared["kvsieve.commands"]
    assert plugins, "no command plugin declared"
    for target in plugins.values():
        module, _, function = target.partition(":")
        unit = unit_of(module, units)
        assert unit is not None and unit.layer > units["kvstore.cli"].layer and not unit.composition_root
        assert module in modules(ROOT), f"{module} does not exist"
        assert function == "register"


IL = "import importlib\n"
FORBIDDEN = {
    "absolute": ("kvstore/bad.py", "import engine_adapter.engine\n", "kvstore.bad -> engine_adapter.engine"),
    "from": ("kvstore/bad.py", "from bench import sidecar\n", "kvstore.bad -> bench.sidecar"),
    "relative to the root": ("kvstore/server/bad.py", "from ..cli import main\n", "-> kvstore.cli.main:"),
    "relative package": ("kvstore/server/bad.py", "from .. import cli\n", "-> kvstore.cli:"),
    "type checking": (
        "kvstore/bad.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine_adapter.engine import Engine\n",
        "kvstore.bad -> engine_adapter.engine",
    ),
    "import_module": ("kvstore/bad.py", IL + 'importlib.import_module("bench.x_bench")\n', "-> bench"),
    "__import__": ("radix/bad.py", '__import__("kvstore.store")\n', "radix (layer 1) may not import kvstore"),
    "constant name": (
        "kvstore/bad.py",
        IL + 'M = "engine_adapter"\nimportlib.import_module(M)\n',
        "-> engine_adapter:",
    ),
    "f-string": ("kvstore/bad.py", IL + 'n = "x"\nimportlib.import_module(f"bench.{n}")\n', "-> bench:"),
    "table of names": (
        "kvstore/bad.py",
        IL + 'T = {"a": "kvstore.errors", "b": "bench.x_bench"}\nimportlib.import_module(T["b"])\n',
        "kvstore.bad -> bench.x_bench",
    ),
    "computed name": ("engine_adapter/bad.py", IL + "importlib.import_module(input())\n", "a computed name"),
    "upward": ("engine_adapter/bad.py", "from bench.sidecar import free_port\n", "may not import bench"),
    "beside": (
        "importance/bad.py",
        "from radix import RadixTree\n",
        "importance (layer 1) may not import radix",
    ),
    "third-party": ("radix/bad.py", "import torch\n", "radix may import only ['numpy']"),
    "banned third-party": (
        "bench/datapath/bad.py",
        "import transformers\n",
        "bench.datapath may not import transformers",
    ),
    "bench subject beside another": (
        "bench/quality/bad.py",
        "from bench.datapath import page_cache\n",
        "bench.quality (layer 13) may not import bench.datapath (layer 13)",
    ),
    "bench helpers upward": (
        "bench/common/bad.py",
        "from bench.quality import masking\n",
        "bench.common (layer 12) may not import bench.quality (layer 13)",
    ),
    "up inside kvstore": (
        "kvstore/tiers/bad.py",
        "from kvstore.store import tiered\n",
        "kvstore.tiers (layer 4) may not import kvstore.store (layer 7)",
    ),
    "client to server": (
        "kvstore/rpc/bad.py",
        "from kvstore.server import app\n",
        "kvstore.rpc (layer 3) may not import kvstore.server (layer 8)",
    ),
    "beside inside kvstore": (
        "kvstore/client/bad.py",
        "import kvstore.server.app\n",
        "kvstore.client (layer 8) may not import kvstore.server (layer 8)",
    ),
    "root upward": (
        "kvstore/cli/main.py",
        "import engine_adapter.commands\n",
        "kvstore.cli.main (layer 15) may not import engine_adapter",
    ),
    "root computed name": (
        "kvstore/cli/main.py",
        IL + "PLUGINS = {}\nimportlib.import_module(PLUGINS['a'])\n",
        "a computed name",
    ),
}
PACKAGE_DIRS = (
    "kvstore/server",
    "kvstore/cli",
    "kvstore/store",
    "kvstore/tiers",
    "kvstore/rpc",
    "kvstore/client",
    "bench/common",
    "bench/datapath",
    "bench/quality",
)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for package in (*PACKAGES, *PACKAGE_DIRS):
        (tmp_path / package).mkdir(exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    for name in ("cli/main", "store/tiered", "server/app", "engine"):
        (tmp_path / "kvstore" / f"{name}.py").write_text("")
    (tmp_path / "engine_adapter" / "engine.py").write_text("")
    (tmp_path / "engine_adapter" / "commands.py").write_text("")
    (tmp_path / "bench" / "sidecar.py").write_text("")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize("case", sorted(FORBIDDEN))
def test_the_checker_flags_a_forbidden_edge(tmp_path: Path, case: str) -> None:
    name, source, expected = FORBIDDEN[case]
    bad = violations(_tree(tmp_path, {name: source}), layer_table())
    assert len(bad) == 1 and expected in bad[0], bad


def test_the_checker_passes_allowed_edges(tmp_path: Path) -> None:
    files = {
        "engine_adapter/ok.py": "import numpy\nfrom kvstore import store\nfrom . import engine\n",
        "bench/datapath/ok.py": "from engine_adapter.runner import engine\nfrom bench.common import texts\n",
        "bench/quality/ok.py": IL + 'importlib.import_module("kvstore.store")\n',
        "bench/ok.py": "from bench.datapath import ok\nfrom kvstore.cli import flags\n",
        "kvstore/cli/main.py": "from kvstore.server import app\nfrom kvstore.store import tiered\n",
        "kvstore/tiers/ok.py": "import lmdb\nfrom kvstore import errors\n",
        "radix/ok.py": "import numpy as np\nimport os\n",
    }
    assert violations(_tree(tmp_path, files), layer_table()) == []


# -- cycles -------------------------------------------------------------------------------------------


def test_kvstore_modules_import_no_cycle() -> None:
    assert import_cycles(ROOT) == []


def test_bench_modules_import_no_cycle() -> None:
    assert import_cycles(ROOT, "bench") == []


def test_the_cycle_check_finds_a_cycle(tmp_path: Path) -> None:
    files = {
        "kvstore/a.py": "from kvstore.b import x\n",
        "kvstore/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvstore.c import y\n",
        "kvstore/c.py": "import kvstore.a\n",
        "kvstore/d.py": "from kvstore import a\n",
    }
    assert import_cycles(_tree(tmp_path, files)) == [["kvstore.a", "kvstore.b", "kvstore.c"]]


# -- one home per name --------------------------------------------------------------------------------


def reexports(root: Path) -> list[str]:
    """Every `from kvstore... import NAME` (in every package and in tests/) whose module does not
    define NAME, and every `__all__` listing a name defined elsewhere, except in FACADES."""
    found = modules(root)
    homes = {module: _defined(path) for module, path in found.items() if module.startswith("kvstore")}
    bad: list[str] = []
    sources = [*found.values(), *sorted((root / "tests").glob("*.py"))]
    for path in sources:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in homes):
                continue
            if node.module in FACADES:
                continue
            for alias in node.names:
                if alias.name not in homes[node.module] and f"{node.module}.{alias.name}" not in found:
                    bad.append(f"{path.relative_to(root)}:{node.lineno}: {alias.name} from {node.module}")
    for module, path in found.items():
        if module in homes and module not in FACADES:
            listed = _all_names(path)
            bad += [f"{path.relative_to(root)}: __all__ lists {name}" for name in listed - homes[module]]
    return bad


def _defined(path: Path) -> set[str]:
    """Names a module defines at its top level (not the ones it imports), in `if`/`try` too."""
    return _defined_in(ast.parse(path.read_text()).body)


def _defined_in(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.If | ast.Try):
            names |= _defined_in([*node.body, *node.orelse])
    return names


def _all_names(path: Path) -> set[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def test_every_name_is_imported_from_its_home() -> None:
    bad = reexports(ROOT)
    assert not bad, "\n".join(bad)


def test_the_home_check_finds_a_reexport(tmp_path: Path) -> None:
    files = {
        "kvstore/errors.py": "class Boom(Exception):\n    pass\n",
        "kvstore/shim.py": "from kvstore.errors import Boom as Boom  # old home\n__all__ = ['Boom']\n",
        "kvstore/user.py": "from kvstore.shim import Boom\nfrom kvstore.errors import Boom as B\n",
        "kvstore/store/__init__.py": (
            "from kvstore.store.tiered import TieredStore\n__all__ = ['TieredStore']\n"
        ),
        "kvstore/store/tiered.py": "class TieredStore:\n    pass\n",
        "kvstore/cli/main.py": "from kvstore.store import TieredStore\n",
    }
    (tmp_path / "tests").mkdir()
    bad = reexports(_tree(tmp_path, files))
    assert sorted(bad) == ["kvstore/shim.py: __all__ lists Boom", "kvstore/user.py:1: Boom from kvstore.shim"]


def test_importing_the_packages_stays_light() -> None:
    code = f"import sys, kvstore, radix, importance; print(sorted(set(sys.modules) & {HEAVY!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
