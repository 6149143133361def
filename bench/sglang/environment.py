"""Where the SGLang environment is: the venv `bench/sglang/setup_sglang.sh` builds, beside
kvsieve's own, in which SGLang's code runs (radix_driver.py, hicache_driver.py)."""

from __future__ import annotations

import os
from pathlib import Path

SGLANG_ENV = Path.home() / ".cache" / "kvsieve" / "sglang-venv"


def sglang_python() -> Path:
    """The interpreter of the SGLang environment (`KVSIEVE_SGLANG_PYTHON` overrides)."""
    return Path(os.environ.get("KVSIEVE_SGLANG_PYTHON", SGLANG_ENV / "bin" / "python"))
