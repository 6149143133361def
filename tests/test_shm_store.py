"""Stores through shared memory against a real `kvsieve serve` on loopback.

The client writes a Store's KV into an arena the server made for it; the server
encodes it from there (the encoding is the one copy), holding the arena until the
reply. A client must not be able to name another tenant's arena, nor change what
was stored by writing the arena afterwards; a stale arena falls back to slices.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import make_kv, make_tokens
from hostile import auth_sidecar, bearer, code_of, raw_stub

from bench.common.sidecar import Sidecar
from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore.client.kvclient import KVClient
from kvstore.model import ModelSpec
from kvstore.rpc import shm
from kvstore.rpc.messages import ctx_to_pb

WIDE = ModelSpec("test-wide", num_layers=8, num_kv_heads=8, head_dim=64)  # 16 KiB per token
pytestmark = pytest.mark.skipif(not shm.available(), reason="no memfd or /proc")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    sidecar = Sidecar(tmp_path_factory.mktemp("shmstore")).start()
    yield sidecar
    sidecar.kill()


def _inline_kv(
    address: str, tokens: np.ndarray, namespace: str = "default", token: str | None = None
) -> bytes:
    with KVClient(address, use_shm=False, token=token) as reader:
        num, _, kv = reader.load_arrays(tokens, model=WIDE, namespace=namespace)
        assert num == len(tokens)
        return kv.tobytes()


def _writable_arena(
    stub: object, nbytes: int, namespace: str, metadata: list[tuple[str, str]]
) -> tuple[str, mmap.mmap]:
    request = pb.CreateArenaRequest(namespace=namespace, nbytes=nbytes, client_pid=os.getpid())
    reply = stub.CreateArena(request, timeout=10, metadata=metadata)  # type: ignore[attr-defined]
    assert reply.accepts_store
    ref = shm.ArenaRef(reply.server_pid, reply.fd, reply.nbytes, reply.inode)
    return reply.arena_id, shm.map_arena(ref, writable=True)


def test_kvclient_stores_through_its_arena_and_the_kv_loads_back_exactly(server: Sidecar) -> None:
    tokens, kv = make_tokens(256, seed=11), make_kv(WIDE, 256, seed=11)
    with KVClient(server.address, use_shm=True) as client:
        result = client.store(tokens, kv, model=WIDE)
        assert result.new_blocks >= 1
        (arena,) = client._arenas._free  # back in the pool, mapped read-write: it carried the KV
        assert arena.writable and arena.buf[: kv.nbytes] == kv.tobytes()
    assert _inline_kv(server.address, tokens) == kv.tobytes()


def test_a_raw_store_through_an_arena_is_copied_out_before_the_reply(server: Sidecar) -> None:
    tokens, kv = make_tokens(256, seed=12), make_kv(WIDE, 256, seed=12)
    with raw_stub(server.address) as stub:
        arena_id, buf = _writable_arena(stub, kv.nbytes, "default", [])
        buf[: kv.nbytes] = kv.tobytes()
        header = pb.StoreHeader(ctx=ctx_to_pb(WIDE, "default"), tokens=tokens.tolist(), arena_id=arena_id)
        reply = stub.Store(iter([pb.StoreRequest(header=header)]), timeout=30)
        assert reply.num_tokens == 256 and reply.new_blocks >= 1
        buf[: kv.nbytes] = bytes(kv.nbytes)  # scribbling afterwards changes nothing stored
        buf.close()
    assert _inline_kv(server.address, tokens) == kv.tobytes()


@pytest.mark.parametrize("problem", ["too_small", "slices_too", "unknown"])
def test_a_bad_store_through_an_arena_is_refused_and_stores_nothing(server: Sidecar, problem: str) -> None:
    tokens, kv = make_tokens(256, seed=20 + len(problem)), make_kv(WIDE, 256, seed=20)
    with raw_stub(server.address) as stub:
        size = kv.nbytes // 2 if problem == "too_small" else kv.nbytes
        arena_id, buf = _writable_arena(stub, size, "default", [])
        buf.close()
        header = pb.StoreHeader(
            ctx=ctx_to_pb(WIDE, "default"), tokens=tokens.tolist(),
            arena_id="0" * 32 if problem == "unknown" else arena_id,
        )  # fmt: skip
        messages = [pb.StoreRequest(header=header)]
        if problem == "slices_too":
            messages.append(
                pb.StoreRequest(slice=pb.KVSlice(start_token=0, num_tokens=256, data=kv.tobytes()))
            )
        expected = grpc.StatusCode.NOT_FOUND if problem == "unknown" else grpc.StatusCode.INVALID_ARGUMENT
        assert code_of(lambda: stub.Store(iter(messages), timeout=30)) == expected
    with KVClient(server.address, use_shm=False) as client:
        assert client.lookup(tokens, model=WIDE).num_tokens == 0


def test_a_stale_arena_falls_back_to_slices(server: Sidecar) -> None:
    first, second = make_tokens(256, seed=31), make_tokens(256, seed=32)
    kv1, kv2 = make_kv(WIDE, 256, seed=31), make_kv(WIDE, 256, seed=32)
    with KVClient(server.address, use_shm=True) as client:
        client.store(first, kv1, model=WIDE)
        (stale,) = client._arenas._free
        client._release_segment(stale.arena_id, "default")  # gone on the server, still in our pool
        assert client.store(second, kv2, model=WIDE).new_blocks >= 1  # NOT_FOUND there: sent as slices
        assert stale not in client._arenas._free  # given up, not reused
    assert _inline_kv(server.address, second) == kv2.tobytes()


def test_another_tenants_arena_cannot_carry_a_store(tmp_path: Path) -> None:
    server = auth_sidecar(tmp_path)
    try:
        tokens, kv = make_tokens(256, seed=41), make_kv(WIDE, 256, seed=41)
        with raw_stub(server.address) as stub:
            arena_id, buf = _writable_arena(stub, kv.nbytes, "a", bearer("tok-a"))
            buf[: kv.nbytes] = kv.tobytes()
            buf.close()
            header = pb.StoreHeader(ctx=ctx_to_pb(WIDE, "b"), tokens=tokens.tolist(), arena_id=arena_id)
            request = [pb.StoreRequest(header=header)]
            code = code_of(lambda: stub.Store(iter(request), timeout=30, metadata=bearer("tok-b")))
            assert code == grpc.StatusCode.PERMISSION_DENIED
        with KVClient(server.address, use_shm=False, token="tok-b") as client:
            assert client.lookup(tokens, model=WIDE, namespace="b").num_tokens == 0
    finally:
        server.kill()
