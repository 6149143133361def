"""`kvsieve bench sglang`: kvsieve as SGLang's HiCache storage, measured with SGLang's own code.

The measurement runs in the SGLang environment that `bench/sglang/setup_sglang.sh` builds
(SGLang on the CPU torch, kvsieve's client beside it), as a subprocess
(`bench/sglang/hicache_driver.py bench`): SGLang's factory loads the backend by
"dynamic", SGLang's host KV pools hold pages of SmolLM2-135M's geometry (30 layers,
3 KV heads, head dim 64, fp16, page size 64: 1,474,560 bytes a page), and a real
`kvsieve serve` started with this interpreter stores them. Without that environment
only `sglang_unavailable` is printed, with the reason.

Published keys (targets from issue 29; ratios of two figures measured side by side):

- `roundtrip_exact`: pages written from a layer-first pool and read back into a
  page-first and a layer-first pool are byte-identical (target true).
- `wrong_pages`: pages handed to SGLang that were not the key's page, across
  another namespace, another TP rank, a forged page and a stopped sidecar (target 0).
- `batch_get_v1_vs_shm_load`: pages per second read by `batch_get_v1` ÷ the same
  bytes loaded by kvsieve's own shared-memory client as one prefix (target >= 0.8).
- `batch_set_v1_vs_shm_store`: bytes per second written by `batch_set_v1` ÷ the same
  bytes stored by kvsieve's own shared-memory client as one prefix (target >= 0.8).
- `batch_exists_128_vs_lookup`: p50 of `batch_exists` over 128 stored pages ÷ p50 of
  one bare Lookup RPC (target <= 1.1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.sglang.environment import sglang_python

_DRIVER = Path(__file__).with_name("hicache_driver.py")


def run(quick: bool = False) -> dict[str, Any]:
    """Run the benchmark; returns the JSON object `kvsieve bench sglang --json` prints."""
    python = sglang_python()
    if not python.exists():
        reason = f"no SGLang environment at {python}: build it with bash bench/sglang/setup_sglang.sh"
        return {"sglang_unavailable": reason}
    with tempfile.TemporaryDirectory() as work:
        cmd = [str(python), str(_DRIVER), "bench", "--kvsieve-python", sys.executable, "--work", work]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        quick_flag = ["--quick"] if quick else []
        result = subprocess.run([*cmd, *quick_flag], capture_output=True, text=True, env=env, timeout=1800)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return {"sglang_unavailable": f"the SGLang driver failed (exit {result.returncode}): {last}"}
    figures: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return figures
