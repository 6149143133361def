"""The house rules a reviewer can count on the module graph of tests/test_layering.py: the runner's
face is the one way into it from above, and rooms, files and functions stay small."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from import_graph import PACKAGES, ROOT, edges_of, modules

RUNNER = "engine_adapter.runner"
#: The faces at engine_adapter's top (commands, engine server, reports) and its package file.
MAX_ENGINE_ADAPTER_TOP_FILES = 6
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def face_violations(root: Path) -> list[str]:
    """Every import of a runner module from outside the runner (the face, the package, is allowed)."""
    found = modules(root)
    known = set(found)
    bad = []
    for module, path in found.items():
        if module == RUNNER or module.startswith(RUNNER + ".") or not module.startswith("engine_adapter"):
            continue
        for edge in edges_of(module, path, known):
            if edge.target.startswith(RUNNER + "."):
                bad.append(f"{path.relative_to(root)}:{edge.line}: {module} -> {edge.target}")
    return bad


def test_the_integrations_and_faces_reach_the_runner_through_its_face() -> None:
    bad = face_violations(ROOT)
    assert not bad, "import these names from engine_adapter.runner:\n" + "\n".join(bad)


def test_the_face_check_finds_a_reach_past_the_face(tmp_path: Path) -> None:
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    for folder in ("runner", "dsl"):
        (tmp_path / "engine_adapter" / folder).mkdir()
        (tmp_path / "engine_adapter" / folder / "__init__.py").write_text("")
    (tmp_path / "engine_adapter" / "runner" / "engine.py").write_text("from engine_adapter.runner import x\n")
    (tmp_path / "engine_adapter" / "dsl" / "ok.py").write_text("from engine_adapter.runner import Engine\n")
    (tmp_path / "engine_adapter" / "dsl" / "bad.py").write_text(
        "from engine_adapter.runner.engine import Engine\n"
    )
    assert face_violations(tmp_path) == [
        "engine_adapter/dsl/bad.py:1: engine_adapter.dsl.bad -> engine_adapter.runner.engine"
    ]


def test_each_name_of_the_face_is_defined_where_the_face_says() -> None:
    runner = importlib.import_module(RUNNER)
    typed = _type_checking_imports(ROOT / "engine_adapter" / "runner" / "__init__.py")
    assert typed == {name: f"{RUNNER}.{home}" for name, home in runner.FACE.items()}
    for name, home in runner.FACE.items():
        assert getattr(runner, name) is getattr(importlib.import_module(f"{RUNNER}.{home}"), name)
    with pytest.raises(AttributeError, match="has no attribute 'prefill_static'"):
        _ = runner.prefill_static


def _type_checking_imports(path: Path) -> dict[str, str]:
    """{name: module} of the `from M import N as N` lines under `if TYPE_CHECKING:`."""
    names: dict[str, str] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for inner in node.body:
                assert isinstance(inner, ast.ImportFrom) and inner.module is not None
                names |= {alias.name: inner.module for alias in inner.names}
    return names


def test_engine_adapter_top_holds_only_its_faces() -> None:
    top = sorted(p.name for p in (ROOT / "engine_adapter").iterdir() if p.is_file())
    assert len(top) <= MAX_ENGINE_ADAPTER_TOP_FILES, top


def test_no_package_file_or_function_is_too_long() -> None:
    long_files, long_functions = [], []
    for module, path in modules(ROOT).items():
        if module.startswith("kvstore._generated"):
            continue
        source = path.read_text()
        if (lines := len(source.splitlines())) > MAX_FILE_LINES:
            long_files.append(f"{path.relative_to(ROOT)}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.end_lineno is None:
                continue
            if (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name} ({length})")
    assert not long_files, f"files over {MAX_FILE_LINES} lines: {long_files}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"
