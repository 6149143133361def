"""Packed tokens and positions on the wire (proto fields added, old ones still served).

A real `kvsieve serve` on loopback, called through raw stubs (what an old or a
new client sends) and through `KVClient`.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from conftest import TINY, make_kv, make_tokens

from bench.common.sidecar import Sidecar
from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore._generated.kvsieve.v1 import kvsieve_pb2_grpc as pb_grpc
from kvstore.client.kvclient import KVClient
from kvstore.rpc.messages import ctx_to_pb

TOKENS = make_tokens(96)  # three blocks of 32 (the sidecar's block size)


@pytest.fixture(scope="module", params=["layered", "importance"])
def sidecar(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Sidecar]:
    server = Sidecar(tmp_path_factory.mktemp("packed"), ["--layout", request.param]).start()
    with KVClient(server.address) as client:
        client.store(TOKENS, make_kv(TINY, 96), model=TINY)
    yield server
    server.kill()


@pytest.fixture
def stub(sidecar: Sidecar) -> Iterator[pb_grpc.KVCacheStub]:
    with grpc.insecure_channel(sidecar.address) as channel:
        yield pb_grpc.KVCacheStub(channel)


def _packed(tokens: np.ndarray) -> bytes:
    return tokens.astype("<u4").tobytes()


def test_packed_and_repeated_tokens_find_the_same_prefix(stub: pb_grpc.KVCacheStub) -> None:
    ctx = ctx_to_pb(TINY, "default")
    old = stub.Lookup(pb.LookupRequest(ctx=ctx, tokens=TOKENS.tolist()))
    new = stub.Lookup(pb.LookupRequest(ctx=ctx, tokens_u32le=_packed(TOKENS)))
    assert (old.num_tokens, new.num_tokens) == (96, 96)
    assert new.packed_tokens
    # The packed field wins over a (wrong) repeated one: only one of them is read.
    mixed = stub.Lookup(pb.LookupRequest(ctx=ctx, tokens=[1, 2, 3], tokens_u32le=_packed(TOKENS[:64])))
    assert mixed.num_tokens == 64


def test_packed_tokens_of_a_partial_u32_are_refused_by_name(stub: pb_grpc.KVCacheStub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.Lookup(pb.LookupRequest(ctx=ctx_to_pb(TINY, "default"), tokens_u32le=b"\x01\x02\x03\x04\x05"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tokens_u32le" in (err.value.details() or "")


def _load_chunks(stub: pb_grpc.KVCacheStub, packed_positions: bool) -> list[pb.Chunk]:
    request = pb.LoadRequest(
        ctx=ctx_to_pb(TINY, "default"), tokens_u32le=_packed(TOKENS), packed_positions=packed_positions
    )
    return [c for r in stub.Load(request) if r.WhichOneof("part") == "batch" for c in r.batch.chunks]


def test_positions_are_packed_only_for_a_client_that_reads_them(stub: pb_grpc.KVCacheStub) -> None:
    old, new = _load_chunks(stub, False), _load_chunks(stub, True)
    assert len(old) == len(new) == 12
    for a, b in zip(old, new, strict=True):
        assert not a.positions_u32le and len(a.positions) == 8
        assert not b.positions and np.frombuffer(b.positions_u32le, "<u4").tolist() == list(a.positions)


def test_client_loads_the_same_kv_with_packed_positions(sidecar: Sidecar) -> None:
    with KVClient(sidecar.address, use_shm=False) as client:
        assert client.lookup(TOKENS, model=TINY).num_tokens == 96
        assert client._packed_tokens  # learned from the reply: later calls send packed tokens only
        n, positions, kv = client.load_arrays(TOKENS, model=TINY)
    assert n == 96 and positions.dtype == np.int64
    order = np.argsort(positions)
    assert np.array_equal(positions[order], np.arange(96))
    assert np.array_equal(kv[:, :, :, order], make_kv(TINY, 96))


def test_shm_arena_holds_the_prefix_in_position_order(sidecar: Sidecar) -> None:
    tokens, kv = make_tokens(64, seed=3), make_kv(TINY, 64, seed=3)
    scores = np.random.default_rng(3).random(64).astype(np.float32)  # chunks in importance order
    with KVClient(sidecar.address, use_shm=True) as client:
        client.store(tokens, kv, model=TINY, scores=scores)
        with client.load(tokens, model=TINY) as stream:
            chunks = list(stream)
            out_of_order = any(not np.all(np.diff(c.positions) == 1) for c in chunks)
            assert out_of_order == ("importance" in sidecar.args)  # the layered layout: prompt order
            for c in chunks:  # each chunk's KV is its tokens' KV, wherever they lie
                assert np.array_equal(c.kv, kv[:, :, :, c.positions])
        with client.load(tokens, model=TINY) as stream:
            positions, loaded = stream.gather(TINY)
            arena = stream.arena_view
            assert arena is not None and np.shares_memory(loaded, arena)  # no reorder copy
            assert np.array_equal(positions, np.arange(64))
            assert np.array_equal(loaded, kv)


def test_shm_load_under_a_budget_gathers_the_selected_tokens_in_order(sidecar: Sidecar) -> None:
    tokens, kv = make_tokens(64, seed=4), make_kv(TINY, 64, seed=4)
    scores = np.random.default_rng(4).random(64).astype(np.float32)
    with KVClient(sidecar.address, use_shm=True) as client:
        client.store(tokens, kv, model=TINY, scores=scores)
        with client.load(tokens, model=TINY, budget=0.5) as stream:
            positions, loaded = stream.gather(TINY)
            assert 0 < len(positions) < 64 and np.all(np.diff(positions) > 0)
            assert np.array_equal(loaded, kv[:, :, :, positions])
