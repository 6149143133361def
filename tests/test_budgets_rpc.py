"""Budgets over the Load RPC (a real gRPC socket) report what the embedded store reports; a
block whose ranking drifted is counted, and after `kvsieve relayout` the same auto budget
reads fewer chunks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import TINY, ServerInThread, make_kv, make_tokens

from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore._generated.kvsieve.v1 import kvsieve_pb2_grpc as pb_grpc
from kvstore.budget import AutoBudget
from kvstore.client.kvclient import KVClient
from kvstore.config import StoreConfig
from kvstore.errors import InvalidInputError
from kvstore.offline.relayout import relayout
from kvstore.rpc.messages import ctx_to_pb
from kvstore.server.config import ServerConfig
from kvstore.store.tiered import TieredStore

BUDGETS: list[Any] = [0.1, 0.25, 0.5, 1.0, "auto", AutoBudget(0.5, 0.2, 0.6)]


def _config(path: Path, layout: str = "layered") -> StoreConfig:
    return StoreConfig(data_dir=path, block_tokens=32, chunk_tokens=8, memory_bytes=16 << 20, layout=layout)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerInThread]:
    from kvstore.server.app import start

    running = ServerInThread(
        start(ServerConfig(listen="127.0.0.1:0", metrics_listen=""), _config(tmp_path / "srv"))
    )
    yield running
    running.stop()


def _summary(stream: Any) -> tuple[Any, ...]:
    with stream:
        positions = sorted(int(p) for c in stream for p in c.positions)
    return (
        positions,
        stream.selected_tokens,
        stream.delivered_tokens,
        stream.delivered_fraction,
        stream.read_fraction,
        round(stream.estimated_coverage, 6),
    )


def test_rpc_reports_the_same_fractions_as_the_embedded_store(tmp_path: Path, server: ServerInThread) -> None:
    tokens, kv = make_tokens(160, seed=5), make_kv(TINY, 160, seed=5)
    scores = np.random.default_rng(5).gamma(0.5, size=160).astype(np.float32)
    with TieredStore(_config(tmp_path / "emb")) as embedded, KVClient(server.address) as client:
        for backend in (embedded, client):
            backend.store(tokens, kv, model=TINY, scores=scores)
        for budget in BUDGETS:
            local = _summary(embedded.load(tokens, model=TINY, budget=budget))
            remote = _summary(client.load(tokens, model=TINY, budget=budget))
            assert remote == local, budget
            assert local[3] == local[2] / 160 and 0.0 < local[4] <= 1.0
        covered = _summary(client.load(tokens, model=TINY, budget="auto", coverage=0.5))
        assert covered == _summary(embedded.load(tokens, model=TINY, budget="auto", coverage=0.5))
        assert covered[5] >= 0.5


def test_rpc_refuses_bad_budgets(server: ServerInThread) -> None:
    with KVClient(server.address) as client:
        with pytest.raises(InvalidInputError, match="unknown word 'all'"):
            client.load(make_tokens(64), model=TINY, budget="all")
        with pytest.raises(InvalidInputError, match=r"coverage must be a fraction in \(0, 1\], got 1.5"):
            client.load(make_tokens(64), model=TINY, budget="auto", coverage=1.5)
    # A raw request (not checked by the client) is refused by the server, naming the word.
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.KVCacheStub(channel)
        for request, named in [
            (pb.LoadRequest(ctx=ctx_to_pb(TINY, "default"), budget_mode="most"), "most"),
            (pb.LoadRequest(ctx=ctx_to_pb(TINY, "default"), budget_mode="auto", coverage=2.0), "coverage"),
            (pb.LoadRequest(ctx=ctx_to_pb(TINY, "default"), budget=1.5), "budget"),
        ]:
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Load(request, timeout=20))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert named in (caught.value.details() or "")


def test_drift_is_counted_and_relayout_lets_auto_read_fewer_chunks(tmp_path: Path) -> None:
    config = _config(tmp_path / "data", "importance")  # drift and re-layout: importance-ordered blocks
    n = 128
    tokens, kv = make_tokens(n, seed=9), make_kv(TINY, n, seed=9)
    rng = np.random.default_rng(9)
    prefill = rng.gamma(0.3, size=n).astype(np.float32)
    history = rng.permutation(prefill) * 1000  # a different ranking, dominating the old one
    with TieredStore(config) as store:
        store.store(tokens, kv, model=TINY, scores=prefill)
        laid_out = _summary(store.load(tokens, model=TINY, budget="auto"))
        store.report_scores(tokens, history, model=TINY)
        assert store.stats().counters["layout_drifted_blocks"] == n // config.block_tokens
        drifted = _summary(store.load(tokens, model=TINY, budget="auto"))
        drifted_quarter = _summary(store.load(tokens, model=TINY, budget=0.25))
    assert drifted[2] > laid_out[2]  # the new top tokens spread over more chunks
    report = relayout(config.data_dir, min_change=0.2)  # type: ignore[arg-type]
    assert report.blocks_rewritten == n // config.block_tokens
    with TieredStore(config) as store:
        relaid = _summary(store.load(tokens, model=TINY, budget="auto"))
        relaid_quarter = _summary(store.load(tokens, model=TINY, budget=0.25))
        assert store.stats().counters.get("layout_drifted_blocks", 0) == 0
    assert relaid[2] < drifted[2]  # same coverage target, fewer chunks
    assert relaid[5] >= drifted[5] - 1e-6 >= 0.9 - 1e-6
    # At a fixed budget the bytes are the same; what re-layout buys is the mass they hold.
    assert relaid_quarter[2] == drifted_quarter[2]
    assert relaid_quarter[5] > drifted_quarter[5]
