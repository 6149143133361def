"""kvsieve runs without its optional extras: the sidecar, the CLI and the store import and serve
with the `events` extra (pyzmq, msgspec) missing.

A fresh interpreter whose import system refuses those packages stands in for a machine that
never installed them (the README's install leaves them out). KV events are then off; asking
for them is the only thing that needs the extra.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_WITHOUT_EVENTS = """
import importlib.abc, sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("msgspec", "zmq"):
            raise ImportError(f"{name} is not installed (refused by the test)")
        return None

sys.meta_path.insert(0, Refuse())
import numpy as np
import kvstore.cli.main, kvstore.server.app
from kvstore.config import StoreConfig
from kvstore.model import ModelSpec
from kvstore.store.tiered import TieredStore

model = ModelSpec("no-extras", num_layers=2, num_kv_heads=2, head_dim=16)
kv = np.random.default_rng(0).standard_normal(model.kv_shape(64)).astype(np.float16)
with TieredStore(StoreConfig(data_dir=sys.argv[1], block_tokens=32)) as store:
    store.store(np.arange(64), kv, model=model)
    covered, _, loaded = store.load_arrays(np.arange(64), model=model)
    assert covered == 64 and loaded.tobytes() == kv.tobytes()
print("served without the events extra")
"""


def test_the_sidecar_and_the_store_import_and_serve_without_the_events_extra(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_EVENTS, str(tmp_path / "data")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "served without the events extra" in result.stdout
