"""Block keys (blake2b hash chain) over an 8k-token prompt: 32 blocks of 256 tokens."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.keys import block_keys

NUM_TOKENS = 8192
BLOCK_TOKENS = 256


def test_block_keys_8k(benchmark: Any) -> None:
    tokens = np.random.default_rng(0).integers(0, 49_152, NUM_TOKENS).astype(np.uint32)
    keys = benchmark(block_keys, tokens, BLOCK_TOKENS, bytes(16), bytes(16))
    assert len(keys) == NUM_TOKENS // BLOCK_TOKENS and len(set(keys)) == len(keys)
