"""Helper process for test_crash.py: stores deterministic prefixes until killed, saying after each."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from kvstore.config import StoreConfig
from kvstore.model import ModelSpec
from kvstore.store.tiered import TieredStore

MODEL = ModelSpec("crash-test", num_layers=8, num_kv_heads=2, head_dim=64)
# Synchronous stores: each "stored" promises the prompt survives a SIGKILL (write-behind's
# crash test is tests/test_write_behind_crash.py).
CONFIG_KW = {"block_tokens": 64, "chunk_tokens": 16, "sync_stores": True}
SHARED = 192  # every prompt of a round starts with the same 3 blocks


def prompt(round_index: int, j: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and KV of prompt j of a round; KV depends on the tokens' seed only."""
    base = np.random.default_rng(round_index).integers(0, 50_000, SHARED)
    own = np.random.default_rng(round_index * 10_000 + j + 1).integers(0, 50_000, 320)
    tokens = np.concatenate([base, own])
    kv = np.empty(MODEL.kv_shape(len(tokens)), np.float16)
    kv[:, :, :, :SHARED] = np.random.default_rng(round_index + 7).standard_normal(MODEL.kv_shape(SHARED))
    own_kv = np.random.default_rng(round_index * 10_000 + j + 7).standard_normal(MODEL.kv_shape(320))
    kv[:, :, :, SHARED:] = own_kv
    return tokens, kv


def main() -> None:
    data_dir, round_index = Path(sys.argv[1]), int(sys.argv[2])
    with TieredStore(StoreConfig(data_dir=data_dir, **CONFIG_KW)) as store:  # type: ignore[arg-type]
        print("ready", flush=True)
        for j in range(10_000):
            tokens, kv = prompt(round_index, j)
            store.store(tokens, kv, model=MODEL)
            print("stored", flush=True)  # the test kills after a chosen number of these


if __name__ == "__main__":
    main()
