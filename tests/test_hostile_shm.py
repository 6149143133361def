"""Hostile clients against the shared-memory path of a real `kvsieve serve` on loopback.

A client must never make the server write outside an arena made for it, nor
crash it, nor reach another tenant's arena, nor leave memory behind when killed.
"""

from __future__ import annotations

import os
import resource
import secrets
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import TINY, make_kv, make_tokens
from hostile import auth_sidecar, bearer, code_of, raw_stub, wait_until

from bench.common.sidecar import Sidecar
from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore.client.kvclient import KVClient
from kvstore.errors import ArenaLimitError
from kvstore.model import ModelSpec
from kvstore.offline.fsck import fsck
from kvstore.rpc import shm
from kvstore.rpc.messages import ctx_to_pb
from kvstore.server.arenas import ArenaCache, Owner

WIDE = ModelSpec("test-wide", num_layers=8, num_kv_heads=8, head_dim=64)  # 16 KiB per token
pytestmark = pytest.mark.skipif(not shm.available(), reason="no memfd or /proc")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Sidecar]:
    sidecar = Sidecar(tmp_path / "data").start()
    yield sidecar
    sidecar.kill()


def _pid(server: Sidecar) -> int:
    assert server.proc is not None
    return server.proc.pid


def _alive_and_serving(server: Sidecar, tokens: object, num_tokens: int) -> None:
    assert server.proc is not None and server.proc.poll() is None
    with KVClient(server.address, use_shm=False) as client:
        assert client.lookup(tokens, model=TINY).num_tokens == num_tokens  # type: ignore[arg-type]


def test_a_symlink_named_like_a_segment_is_never_written(server: Sidecar, tmp_path: Path) -> None:
    tokens, kv = make_tokens(96, seed=1), make_kv(TINY, 96, seed=1)
    with KVClient(server.address, use_shm=False) as client:
        client.store(tokens, kv, model=TINY)
        # the disk's group commit behind the Store, done before the file's bytes are taken
        assert wait_until(lambda: client.stats().counters.get("disk_backlog_blocks") == 0, 30)
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious" * 4096)
    data_mdb = tmp_path / "data" / "lmdb" / "data.mdb"
    before = {victim: victim.read_bytes(), data_mdb: data_mdb.read_bytes()}
    links = []
    try:
        for target in (victim, data_mdb):
            name = f"kvsieve-{os.getpid()}-{secrets.token_hex(8)}"  # exactly the old segment pattern
            (shm.SHM_DIR / name).symlink_to(target)
            links.append(shm.SHM_DIR / name)
            with raw_stub(server.address) as stub:
                ctx = ctx_to_pb(TINY, "default")
                for request in (  # the old field, and the name passed off as an arena id
                    pb.LoadRequest(ctx=ctx, tokens=tokens.tolist(), shm_name=name, shm_bytes=1 << 20),
                    pb.LoadRequest(ctx=ctx, tokens=tokens.tolist(), arena_id=name),
                ):
                    replies = list(stub.Load(request, timeout=30))
                    assert not replies[0].header.shm  # the server wrote nowhere but the stream
                    inline = b"".join(c.data for r in replies[1:-1] for c in r.batch.chunks)
                    assert len(inline) == 96 * TINY.token_bytes
    finally:
        for link in links:
            link.unlink()
    assert {path: path.read_bytes() for path in before} == before
    _alive_and_serving(server, tokens, 96)
    server.kill()
    assert fsck(tmp_path / "data").clean


def test_an_arena_cannot_be_truncated_under_the_server(server: Sidecar) -> None:
    tokens, kv = make_tokens(640, seed=2), make_kv(TINY, 640, seed=2)
    with KVClient(server.address, use_shm=True) as client:
        client.store(tokens, kv, model=TINY)
        with raw_stub(server.address) as stub:
            reply = stub.CreateArena(
                pb.CreateArenaRequest(namespace="default", nbytes=1 << 20, client_pid=os.getpid()), timeout=10
            )
            ref = shm.ArenaRef(reply.server_pid, reply.fd, reply.nbytes, reply.inode)
            fd = os.open(ref.path, os.O_RDWR)  # the hostile client opens it writable ...
            try:
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, 0)  # ... and cannot shrink it: F_SEAL_SHRINK
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, 2 << 20)  # nor grow it: F_SEAL_GROW
                assert os.fstat(fd).st_size == 1 << 20
            finally:
                os.close(fd)
            request = pb.LoadRequest(
                ctx=ctx_to_pb(TINY, "default"), tokens=tokens.tolist(), arena_id=reply.arena_id
            )
            replies = list(stub.Load(request, timeout=30))
            assert replies[0].header.shm and replies[-1].trailer.num_tokens == 640
        buf = shm.map_arena(ref)
        dense = shm.dense_view(buf, TINY)
        assert dense[:, :, :, :640].tobytes() == kv.tobytes()  # natural order: no scores were stored
        del dense
        buf.close()
    _alive_and_serving(server, tokens, 640)


def test_out_of_memory_for_an_arena_is_a_clean_error_and_loads_go_inline(tmp_path: Path) -> None:
    # A real kernel refusal: files (memfds too) larger than RLIMIT_FSIZE cannot be made.
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    arenas = ArenaCache()
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(ArenaLimitError, match="cannot reserve a 4194304 B shared-memory arena"):
            arenas.create(Owner(None, "default"), 4 << 20, os.getpid())
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert len(arenas) == 0
    # Over the server's configured arena size: the client silently loads inline, bit-exact.
    server = Sidecar(tmp_path / "data", ["--shm-arena-bytes", "1MiB"]).start()
    try:
        tokens, kv = make_tokens(128, seed=3), make_kv(WIDE, 128, seed=3)  # 2 MiB of KV
        with KVClient(server.address, use_shm=True) as client:
            client.store(tokens, kv, model=WIDE)
            with client.load(tokens, model=WIDE) as stream:
                positions, loaded = stream.gather(WIDE)
                assert stream.arena_view is None
            assert loaded.tobytes() == kv[:, :, :, positions].tobytes()
            assert shm.open_arenas(_pid(server)) == []
    finally:
        server.kill()


def test_another_tenants_arena_is_refused_in_load_and_release(tmp_path: Path) -> None:
    server = auth_sidecar(tmp_path)
    tokens, kv = make_tokens(96, seed=4), make_kv(TINY, 96, seed=4)
    try:
        with KVClient(server.address, token="tok-a", use_shm=True) as tenant_a:
            tenant_a.store(tokens, kv, model=TINY, namespace="a")
            stream = tenant_a.load(tokens, model=TINY, namespace="a")
            positions, view = stream.gather(TINY)
            assert stream.arena_view is not None and np.shares_memory(view, stream.arena_view)
            arena_id = stream._arena.arena_id  # type: ignore[union-attr]  # as if it had leaked
            seen = view.tobytes()
            b_tokens = make_tokens(96, seed=5)
            with raw_stub(server.address) as stub:
                b_ctx, meta = ctx_to_pb(TINY, "b"), bearer("tok-b")
                tenant_b = KVClient(server.address, token="tok-b", use_shm=False)
                tenant_b.store(b_tokens, make_kv(TINY, 96, seed=5), model=TINY, namespace="b")
                tenant_b.close()
                load = pb.LoadRequest(ctx=b_ctx, tokens=b_tokens.tolist(), arena_id=arena_id)
                assert (
                    code_of(lambda: stub.Load(load, timeout=10, metadata=meta))
                    == grpc.StatusCode.PERMISSION_DENIED
                )
                for namespace in ("b", "a"):
                    release = pb.ReleaseSegmentRequest(namespace=namespace, arena_id=arena_id)
                    assert (
                        code_of(lambda r=release: stub.ReleaseSegment(r, timeout=10, metadata=meta))  # type: ignore[misc]
                        == grpc.StatusCode.PERMISSION_DENIED
                    )
            assert view.tobytes() == seen == kv[:, :, :, positions].tobytes()  # the victim's view is intact
            stream.close()
            with tenant_a.load(tokens, model=TINY, namespace="a") as again:  # and its arena still works
                _, view2 = again.gather(TINY)
                assert again.arena_view is not None and np.shares_memory(view2, again.arena_view)
                assert again._arena.arena_id == arena_id  # type: ignore[union-attr]
    finally:
        server.kill()


def test_arenas_are_bound_to_the_namespace_without_auth(server: Sidecar) -> None:
    tokens = make_tokens(64, seed=6)
    with KVClient(server.address, use_shm=True) as client:
        client.store(tokens, make_kv(TINY, 64, seed=6), model=TINY, namespace="ns-a")
        with client.load(tokens, model=TINY, namespace="ns-a") as stream:
            list(stream)
            arena_id = stream._arena.arena_id  # type: ignore[union-attr]
        with raw_stub(server.address) as stub:
            load = pb.LoadRequest(ctx=ctx_to_pb(TINY, "ns-b"), tokens=tokens.tolist(), arena_id=arena_id)
            assert code_of(lambda: stub.Load(load, timeout=10)) == grpc.StatusCode.PERMISSION_DENIED
            release = pb.ReleaseSegmentRequest(namespace="ns-b", arena_id=arena_id)
            assert (
                code_of(lambda: stub.ReleaseSegment(release, timeout=10)) == grpc.StatusCode.PERMISSION_DENIED
            )
            unknown = pb.ReleaseSegmentRequest(namespace="ns-a", arena_id="f" * 32)
            assert code_of(lambda: stub.ReleaseSegment(unknown, timeout=10)) == grpc.StatusCode.NOT_FOUND


_VICTIM = textwrap.dedent(
    """
    import os, sys, time
    import grpc
    from kvstore.rpc import shm
    from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb, kvsieve_pb2_grpc as pb_grpc
    from kvstore.model import ModelSpec
    from kvstore.rpc.messages import ctx_to_pb

    address, phase, num_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = ModelSpec("test-wide", num_layers=8, num_kv_heads=8, head_dim=64)
    stub = pb_grpc.KVCacheStub(grpc.insecure_channel(address))
    create = pb.CreateArenaRequest(namespace="default", nbytes=1 << 20, client_pid=os.getpid())
    arena = stub.CreateArena(create)
    buf = shm.map_arena(shm.ArenaRef(arena.server_pid, arena.fd, arena.nbytes, arena.inode))
    if phase == "during":
        tokens = list(range(num_tokens))
        request = pb.LoadRequest(ctx=ctx_to_pb(model, "default"), tokens=tokens, arena_id=arena.arena_id)
        replies = stub.Load(request)
        header, first = next(replies), next(replies)
        assert header.header.shm and first.WhichOneof("part") == "batch"
    print("ready", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("phase", ["before", "during"])
def test_a_client_killed_before_or_during_a_load_leaves_no_arena(server: Sidecar, phase: str) -> None:
    wide = WIDE
    num_tokens = 2048  # 32 MiB: 1 MiB goes to the arena, the rest inline, held back by flow control
    tokens = np.arange(num_tokens)
    if phase == "during":
        with KVClient(server.address, use_shm=False) as client:
            client.store(tokens, make_kv(wide, num_tokens, seed=7), model=wide)
    victim = subprocess.Popen(
        [sys.executable, "-c", _VICTIM, server.address, phase, str(num_tokens)],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ),
    )  # fmt: skip
    try:
        assert victim.stdout is not None and victim.stdout.readline().strip() == "ready"
        assert len(shm.open_arenas(_pid(server))) == 1  # the arena exists, mapped by both
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(10) == -signal.SIGKILL
    finally:
        victim.kill()
        victim.wait(10)
    # The server notices the exited client (the sweep runs every 2 s and at every arena call).
    assert wait_until(lambda: shm.open_arenas(_pid(server)) == [])
    assert shm.leaked_segments() == []
    _alive_and_serving(server, make_tokens(32), 0)
