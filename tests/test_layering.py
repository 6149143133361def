"""Imports point downward only (see DESIGN.md, "Layers"); walked from the source."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = {"torch", "transformers", "grpc", "lmdb", "redis", "accelerate"}


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def top(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize("package", ["radix", "importance"])
def test_radix_and_importance_import_no_grpc_torch_model_or_store(package: str) -> None:
    for path in files(package):
        bad = {n for n in imports_of(path) if top(n) in HEAVY | {"kvstore", "engine_adapter"}}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_only_engine_adapter_imports_transformers() -> None:
    for package in ("kvstore", "radix", "importance", "bench"):
        for path in files(package):
            bad = {n for n in imports_of(path) if top(n) in {"transformers", "accelerate"}}
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_tiers_and_codec_import_no_siblings() -> None:
    allowed = {"kvstore.errors", "kvstore.keys", "kvstore.meta", "kvstore.model"}
    for path in [*files("kvstore/tiers"), ROOT / "kvstore" / "codec.py"]:
        siblings = {n for n in imports_of(path) if top(n) == "kvstore" and not n.startswith("kvstore.tiers")}
        assert siblings <= allowed, f"{path.relative_to(ROOT)} imports {siblings - allowed}"


def test_lower_layers_do_not_import_upper_ones() -> None:
    for path in files("kvstore"):
        # The command line is the composition root: it wires every layer together (lazily).
        if "_generated" in path.parts or path.name == "cli.py":
            continue
        bad = {n for n in imports_of(path) if top(n) == "engine_adapter"}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_importing_the_packages_stays_light() -> None:
    code = f"import sys, kvstore, radix, importance; print(sorted(set(sys.modules) & {HEAVY!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
