"""The engine's choice between loading and computing (engine_adapter/runner/choice.py): what deciding
costs a request, which issue 47 holds to 1 ms.

- `choose` for an 8B-shaped prefix of 4k and 32k tokens (256-token blocks: 17 options, recompute,
  a full load and 15 splits), warm where recompute and the full load were measured (a repeat
  request: the measured branch) and cold with nothing measured there yet (every option estimated);
- `request_for`: where the request stands, the one lookup of a real store holding the prefix (128
  blocks at 32k tokens), as the engine makes it before choosing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from engine_adapter.runner.choice import choose, request_for
from engine_adapter.runner.costs import CostModel
from engine_adapter.runner.plans import FULL, RECOMPUTE, Option, Request
from kvstore.config import StoreConfig
from kvstore.model import ModelSpec
from kvstore.store.tiered import TieredStore

TOKEN_BYTES = 128 << 10  # an 8B model's KV per token in fp16
BLOCK = 256
SMALL = ModelSpec("micro-choice", num_layers=2, num_kv_heads=1, head_dim=8)  # KV bytes do not matter here


def _costs() -> CostModel:
    costs = CostModel()
    costs.observe_read("disk", int(1.7e9), 1.0)
    for n in (1024, 4096, 16384):
        costs.observe_prefill(n, 0, n / 30_000)
    return costs


@pytest.mark.parametrize("tokens", [4096, 32768])
@pytest.mark.parametrize("state", ["warm-measured", "cold-estimated"])
def test_choose(benchmark: Any, tokens: int, state: str) -> None:
    costs = _costs()
    warm = state == "warm-measured"
    request = Request(tokens + 64, tokens, 1.0 if warm else 0.0, TOKEN_BYTES, BLOCK)
    if warm:
        for _ in range(8):  # past the place's first requests: no option is tried on its estimate
            costs.record(Option(RECOMPUTE), request, tokens * 3e-5)
            costs.record(Option(FULL), request, tokens * 8e-6)
    plan = benchmark(choose, costs, request)
    assert plan.measured == warm and plan.kind in (FULL, RECOMPUTE, "split")


@pytest.fixture(scope="module")
def store_32k() -> Iterator[tuple[TieredStore, np.ndarray[Any, Any]]]:
    tokens = np.random.default_rng(0).integers(0, 49_152, 32768 + 64).astype(np.uint32)
    kv = np.zeros((SMALL.num_layers, 2, SMALL.num_kv_heads, 32768, SMALL.head_dim), np.float16)
    with TieredStore(StoreConfig(memory_bytes=256 << 20, block_tokens=BLOCK)) as store:
        store.store(tokens[:32768], kv, model=SMALL)
        yield store, tokens


def test_request_for_32k(benchmark: Any, store_32k: tuple[TieredStore, np.ndarray[Any, Any]]) -> None:
    store, tokens = store_32k
    ids = tokens.tolist()
    request = benchmark(request_for, store, ids, SMALL, "default", split=True, query_aware=None)
    assert request.prefix_tokens == 32768 and request.memory_fraction == 1.0
