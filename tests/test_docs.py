"""The README's example runs as written."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_python_example_runs(tmp_path: Path, capsys) -> None:
    text = (ROOT / "README.md").read_text()
    example = re.search(r"```python\n(.*?)```", text, re.S)
    assert example is not None
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(example.group(1), "README.md", "exec"), {})
    finally:
        os.chdir(cwd)
    out = capsys.readouterr().out
    assert "num_tokens=512" in out
    assert (tmp_path / "kv-data" / "lmdb" / "data.mdb").exists()
