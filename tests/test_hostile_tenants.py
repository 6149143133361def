"""Cross-tenant matrix over every KVCache RPC on a real `kvsieve serve` with tokens.

Tenant B's token must never see or touch tenant A's data, figures, leases or arenas;
an admin token (granted "*") sees the whole store.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import TINY, make_kv, make_tokens
from hostile import auth_sidecar, bearer, code_of, raw_stub

from bench.common.sidecar import Sidecar
from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore._generated.kvsieve.v1 import kvsieve_pb2_grpc as pb_grpc
from kvstore.client.kvclient import KVClient
from kvstore.rpc import shm
from kvstore.rpc.messages import ctx_to_pb

DENIED = grpc.StatusCode.PERMISSION_DENIED
A_TOKENS, A_KV = make_tokens(96, seed=21), make_kv(TINY, 96, seed=21)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Sidecar]:
    sidecar = auth_sidecar(tmp_path)
    yield sidecar
    sidecar.kill()


def _victim_state(server: Sidecar) -> tuple[Any, ...]:
    """What tenant A sees: its prefix, its KV, its figures."""
    with KVClient(server.address, token="tok-a", use_shm=False) as a:
        covered, positions, kv = a.load_arrays(A_TOKENS, model=TINY, namespace="a")
        stats = a.stats()
        return covered, positions.tolist(), kv.tobytes(), stats.num_blocks, stats.active_leases


def _attacks(stub: pb_grpc.KVCacheStub, lease_id: str, arena_id: str) -> dict[str, Callable[[], object]]:
    """Every RPC, made with tenant B's token against tenant A's namespace, lease or arena."""
    meta, ctx_a, ctx_b = bearer("tok-b"), ctx_to_pb(TINY, "a"), ctx_to_pb(TINY, "b")
    toks = A_TOKENS.tolist()
    store = [
        pb.StoreRequest(header=pb.StoreHeader(ctx=ctx_a, tokens=toks)),
        pb.StoreRequest(slice=pb.KVSlice(start_token=0, num_tokens=96, data=make_kv(TINY, 96).tobytes())),
    ]
    kw: dict[str, Any] = {"timeout": 10, "metadata": meta}
    return {
        "Lookup": lambda: stub.Lookup(pb.LookupRequest(ctx=ctx_a, tokens=toks), **kw),
        "Store": lambda: stub.Store(iter(store), **kw),
        "Load": lambda: stub.Load(pb.LoadRequest(ctx=ctx_a, tokens=toks), **kw),
        "ReportScores": lambda: stub.ReportScores(
            pb.ReportScoresRequest(ctx=ctx_a, tokens=toks, scores=[1.0] * 96), **kw
        ),
        "Pin": lambda: stub.Pin(pb.PinRequest(ctx=ctx_a, tokens=toks, ttl_s=60), **kw),
        "Unpin": lambda: stub.Unpin(pb.UnpinRequest(lease_id=lease_id), **kw),
        "CreateArena": lambda: stub.CreateArena(
            pb.CreateArenaRequest(namespace="a", nbytes=1 << 20, client_pid=os.getpid()), **kw
        ),
        "ReleaseSegment(a)": lambda: stub.ReleaseSegment(
            pb.ReleaseSegmentRequest(namespace="a", arena_id=arena_id), **kw
        ),
        "ReleaseSegment(b)": lambda: stub.ReleaseSegment(
            pb.ReleaseSegmentRequest(namespace="b", arena_id=arena_id), **kw
        ),
        "Load(b, A's arena)": lambda: stub.Load(
            pb.LoadRequest(ctx=ctx_b, tokens=toks, arena_id=arena_id), **kw
        ),
    }


@pytest.mark.skipif(not shm.available(), reason="no memfd or /proc")
def test_tenant_b_can_never_see_or_touch_tenant_a(server: Sidecar) -> None:
    with KVClient(server.address, token="tok-a", use_shm=True) as a:
        a.store(A_TOKENS, A_KV, model=TINY, namespace="a")
        lease = a.pin(A_TOKENS, model=TINY, namespace="a", ttl_s=600)
        with a.load(A_TOKENS, model=TINY, namespace="a") as stream:
            _, view = stream.gather(TINY)
            assert stream.arena_view is not None and np.shares_memory(view, stream.arena_view)
            arena_id = stream._arena.arena_id  # type: ignore[union-attr]
        before = _victim_state(server)
        with raw_stub(server.address) as stub:
            codes = {name: code_of(call) for name, call in _attacks(stub, lease.lease_id, arena_id).items()}
        assert codes == dict.fromkeys(codes, DENIED)
        assert _victim_state(server) == before  # nothing of A's changed, its lease still holds
        assert before[0] == 96 and before[2] == A_KV.tobytes() and before[4] == 1
        with a.load(A_TOKENS, model=TINY, namespace="a") as stream:  # A's arena survived
            stream.gather(TINY)
            assert stream._arena.arena_id == arena_id  # type: ignore[union-attr]


def test_stats_show_a_tenant_only_its_own_namespaces(server: Sidecar) -> None:
    with KVClient(server.address, token="tok-a") as a:
        a.store(A_TOKENS, A_KV, model=TINY, namespace="a")
        a.pin(A_TOKENS, model=TINY, namespace="a")
        for _ in range(3):
            a.lookup(A_TOKENS, model=TINY, namespace="a")
        a.load_arrays(A_TOKENS, model=TINY, namespace="a")
        mine = a.stats()
    assert (mine.num_blocks, mine.active_leases) == (3, 1)
    figures = [mine.get(name) for name in ("lookups", "stores", "loads", "blocks_written")]
    assert figures == [3, 1, 1, 3]
    assert list(mine.tiers) == ["namespace"]  # never the shared tiers' totals
    with KVClient(server.address, token="tok-b") as b:
        theirs = b.stats()
        assert (theirs.num_blocks, theirs.active_leases, theirs.counters) == (0, 0, {})
        assert theirs.tiers["namespace"].used_bytes == 0
        b.store(make_tokens(32, seed=22), make_kv(TINY, 32), model=TINY, namespace="b")
        assert b.stats().num_blocks == 1
    with KVClient(server.address, token="tok-admin") as admin:
        everything = admin.stats()
    assert everything.num_blocks == 4 and everything.active_leases == 1 and "lmdb" in everything.tiers
    assert everything.get("lookups") >= 3
