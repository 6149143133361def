"""The PrefixStore contract: the embedded store, the gRPC client and the gRPC client over
shared memory give the same answers to the same calls, bad input included."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import TINY, make_kv, make_tokens

from kvstore.api import PrefixStore
from kvstore.client.kvclient import KVClient
from kvstore.config import StoreConfig
from kvstore.errors import InvalidInputError, NotFoundError
from kvstore.store.tiered import TieredStore


@pytest.fixture(params=["embedded", "grpc", "grpc-shm"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[PrefixStore]:
    """The same API, embedded or remote; each test uses its own namespace."""
    if request.param == "embedded":
        config = StoreConfig(data_dir=tmp_path / "embedded", block_tokens=32, chunk_tokens=8)
        with TieredStore(config) as store:
            yield store
    else:
        server = request.getfixturevalue("sidecar")
        with KVClient(server.address, use_shm=request.param == "grpc-shm") as client:
            yield client


@pytest.fixture
def ns(request: pytest.FixtureRequest) -> str:
    return request.node.name[:200]


def test_contract_store_lookup_load(backend: PrefixStore, ns: str) -> None:
    tokens, kv = make_tokens(100, seed=1), make_kv(TINY, 100, seed=1)
    result = backend.store(tokens, kv, model=TINY, namespace=ns)
    assert (result.num_tokens, result.new_blocks) == (96, 3)
    assert backend.lookup(tokens, model=TINY, namespace=ns).num_tokens == 96
    covered, positions, loaded = backend.load_arrays(tokens, model=TINY, namespace=ns)
    assert covered == 96 and positions.tolist() == list(range(96))
    assert loaded.tobytes() == kv[:, :, :, :96].tobytes()
    assert backend.store(tokens, kv, model=TINY, namespace=ns).new_blocks == 0


def test_contract_namespaces_isolate(backend: PrefixStore, ns: str) -> None:
    tokens, kv = make_tokens(64, seed=2), make_kv(TINY, 64, seed=2)
    backend.store(tokens, kv, model=TINY, namespace=ns)
    assert backend.lookup(tokens, model=TINY, namespace=ns + "-other").num_tokens == 0
    assert backend.load_arrays(tokens, model=TINY, namespace=ns + "-other")[0] == 0


def test_contract_partial_budget(backend: PrefixStore, ns: str) -> None:
    tokens, kv = make_tokens(64, seed=3), make_kv(TINY, 64, seed=3)
    scores = np.linspace(0, 1, 64).astype(np.float32)
    backend.store(tokens, kv, model=TINY, namespace=ns, scores=scores)
    stream = backend.load(tokens, model=TINY, namespace=ns, budget=0.25)
    chunks = list(stream)
    assert stream.selected_tokens == 16
    got = sorted(int(p) for c in chunks for p in c.positions)
    assert got == list(range(48, 64))  # the highest scores sit at the end of block 1
    for c in chunks:
        assert c.kv.tobytes() == kv[:, :, :, c.positions].tobytes()
    stream.close()


def _short_kv(b: PrefixStore, ns: str) -> Any:
    return b.store(make_tokens(64), make_kv(TINY, 63), model=TINY, namespace=ns)


def _wrong_dtype(b: PrefixStore, ns: str) -> Any:
    return b.store(make_tokens(64), make_kv(TINY, 64).astype(np.float32), model=TINY, namespace=ns)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (_short_kv, "shape"),
        (lambda b, ns: b.load(make_tokens(64), model=TINY, namespace=ns, budget=1.5), "budget"),
        (lambda b, ns: b.lookup([-1, 2], model=TINY, namespace=ns), r"\[0, "),
        (_wrong_dtype, "dtype"),
    ],
)
def test_contract_bad_input_is_invalid_and_writes_nothing(
    backend: PrefixStore, ns: str, call: Any, message: str
) -> None:
    with pytest.raises(InvalidInputError, match=message):
        result = call(backend, ns)
        list(result)  # a load raises when its stream is read
    assert backend.lookup(make_tokens(64), model=TINY, namespace=ns).num_tokens == 0


def test_contract_leases(backend: PrefixStore, ns: str) -> None:
    tokens = make_tokens(64, seed=4)
    backend.store(tokens, make_kv(TINY, 64, seed=4), model=TINY, namespace=ns)
    lease = backend.pin(tokens, model=TINY, namespace=ns, ttl_s=30)
    assert lease.num_keys == 2 and lease.ttl_s == 30
    backend.unpin(lease.lease_id)
    with pytest.raises(NotFoundError):
        backend.unpin(lease.lease_id)


def test_contract_report_scores_and_stats(backend: PrefixStore, ns: str) -> None:
    tokens = make_tokens(64, seed=5)
    backend.store(tokens, make_kv(TINY, 64, seed=5), model=TINY, namespace=ns)
    assert backend.report_scores(tokens, np.ones(64, np.float32), model=TINY, namespace=ns) == 2
    stats = backend.stats()
    assert stats.get("score_reports") >= 1 and stats.num_blocks >= 2
