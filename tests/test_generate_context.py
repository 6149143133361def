"""`kvsieve generate --context FILE`: the README's first command shows reuse on its second run."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import kvsieve

PRIMER = Path(__file__).parent.parent / "examples" / "kv-cache-primer.txt"


def generate(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return kvsieve("generate", *args, stdin=stdin, timeout=600)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing.txt", "is not a readable file"),
        (lambda d: d, "is not a readable file"),  # a directory
        (lambda d: _write(d / "empty.txt", b"  \n"), "is empty"),
        (lambda d: _write(d / "bin.txt", b"\xff\xfe\x00bad"), "is not UTF-8 text"),
    ],
)
def test_bad_context_is_refused_before_the_model_loads(
    tmp_path: Path, make: Callable[[Path], Path], message: str
) -> None:
    path = make(tmp_path)
    result = generate("--context", str(path), "Q?", "--data-dir", str(tmp_path / "data"))
    assert result.returncode == 2
    assert message in result.stderr and str(path) in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "data").exists()  # refused before any store was opened


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.model
@pytest.mark.slow
def test_second_run_loads_the_document_instead_of_computing_it(tmp_path: Path) -> None:
    args = ["--context", str(PRIMER), "What is attention?", "-v", "--max-tokens", "4"]
    args += ["--data-dir", str(tmp_path / "data")]
    first = generate(*args)
    assert first.returncode == 0, first.stderr[-2000:]
    stored = re.search(r"reuse: none yet; (\d+) blocks stored", first.stderr)
    assert stored is not None and int(stored.group(1)) == 4, first.stderr  # the primer fills 4 blocks
    second = generate(*args)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "1024 cached, 1024 loaded" in second.stderr and "reuse: 1024 of" in second.stderr
    assert second.stdout == first.stdout  # the same greedy answer from loaded KV


@pytest.mark.model
@pytest.mark.slow
def test_context_from_stdin_matches_the_file(tmp_path: Path) -> None:
    common = ["What is attention?", "--max-tokens", "4", "--no-store"]
    from_file = generate("--context", str(PRIMER), *common)
    from_stdin = generate("--context", "-", *common, stdin=PRIMER.read_text())
    assert from_file.returncode == 0 and from_stdin.returncode == 0, from_stdin.stderr[-2000:]
    assert from_stdin.stdout == from_file.stdout
