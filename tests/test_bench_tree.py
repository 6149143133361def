"""bench/ by subject (docs/architecture.md, "bench, by subject"): its top level is the command
table alone, and every bench path or module that the docs, CI, the tests and bench itself name
exists, so that a move cannot leave a stale name behind."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Where bench's files are named for readers and for CI. tests/test_layering.py is left out: its
#: checker runs on made-up trees, with bench modules that exist only there.
NAMING = [
    ROOT / "README.md",
    ROOT / ".ci" / "run",
    ROOT / "pyproject.toml",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted(p for p in (ROOT / "tests").glob("*.py") if p.name != "test_layering.py"),
    *sorted(p for p in (ROOT / "bench").rglob("*") if p.suffix in (".py", ".sh")),
]
PATH = re.compile(r"(?<![\w./-])bench/[a-z_][a-z0-9_/]*\.(?:py|sh)\b")
MODULE = re.compile(r"(?<![\w./-])bench(?:\.[a-z_]\w*)+")


def test_the_top_level_of_bench_is_the_command_table_only() -> None:
    """A benchmark or a helper belongs to a subject's folder (or to common/ when shared)."""
    files = sorted(p.name for p in (ROOT / "bench").iterdir() if p.is_file())
    assert files == ["__init__.py", "commands.py"]


def test_every_bench_path_and_module_named_exists() -> None:
    missing: list[str] = []
    for source in NAMING:
        text = "\n".join(_without_first_cell(line) for line in source.read_text().splitlines())
        names = [path for path in PATH.findall(text) if not (ROOT / path).exists()]
        names += [name for name in MODULE.findall(text) if not _module_prefix_exists(name)]
        missing += [f"{source.relative_to(ROOT)}: {name}" for name in names]
    assert missing == []


def _without_first_cell(line: str) -> str:
    """A markdown row less its first cell: a "Was | Is" table names in it what no longer exists."""
    return line.split("|", 2)[2] if line.startswith("|") and line.count("|") > 2 else line


def _module_prefix_exists(name: str) -> bool:
    """`bench.SUBJECT.MODULE.NAME`: a prefix of two parts or more is a package or a module."""
    parts = name.split(".")
    for n in range(len(parts), 1, -1):
        path = ROOT.joinpath(*parts[:n])
        if (path / "__init__.py").exists() or path.with_suffix(".py").exists():
            return True
    return False


def test_the_setup_scripts_run_files_beside_them() -> None:
    """They run from anywhere (`bash bench/sglang/setup_sglang.sh`): every `$(dirname "$0")/...`."""
    scripts = sorted((ROOT / "bench").rglob("setup_*.sh"))
    assert scripts
    for script in scripts:
        for rel in re.findall(r'\$\(dirname "\$0"\)/([\w./]+)', script.read_text()):
            target = (script.parent / rel).resolve()
            assert target.exists(), f"{script.relative_to(ROOT)}: {rel}"
            if set(rel.split("/")) == {".."}:
                assert target == ROOT, f"{script.relative_to(ROOT)}: {rel} is not the checkout"
