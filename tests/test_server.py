"""The sidecar over a real socket: contract parity with the embedded store, concurrency,
crashes, auth, errors, shared memory, health, reflection and metrics."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import TINY, make_kv, make_tokens

from bench.common.sidecar import Sidecar, free_port
from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore._generated.kvsieve.v1 import kvsieve_pb2_grpc as pb_grpc
from kvstore.client.kvclient import KVClient
from kvstore.errors import PermissionDeniedError, RpcFailedError, UnauthenticatedError
from kvstore.model import ModelSpec
from kvstore.offline.fsck import fsck
from kvstore.rpc import shm
from kvstore.rpc.messages import ctx_to_pb


def test_eight_concurrent_clients_get_bit_exact_results(sidecar: Sidecar) -> None:
    errors: list[BaseException] = []
    shared_tokens, shared_kv = make_tokens(96, seed=50), make_kv(TINY, 96, seed=50)

    def worker(i: int) -> None:
        try:
            with KVClient(sidecar.address, use_shm=i % 2 == 0) as client:
                own_tokens, own_kv = make_tokens(96, seed=100 + i), make_kv(TINY, 96, seed=100 + i)
                for _ in range(5):
                    for tokens, kv in ((shared_tokens, shared_kv), (own_tokens, own_kv)):
                        client.store(tokens, kv, model=TINY, namespace="concurrent")
                        covered, _, loaded = client.load_arrays(tokens, model=TINY, namespace="concurrent")
                        assert covered == 96 and loaded.tobytes() == kv[:, :, :, :96].tobytes()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive()
    assert not errors, errors


# 16 KiB of KV per token: a 2048-token load (32 MiB) is far larger than what gRPC buffers in
# flight, so a stream read one chunk at a time is really still open on the server.
WIDE = ModelSpec("test-wide", num_layers=8, num_kv_heads=8, head_dim=64)
WIDE_TOKENS = 2048


def _store_wide(address: str, seed: int) -> tuple[Any, Any]:
    tokens, kv = make_tokens(WIDE_TOKENS, seed=seed), make_kv(WIDE, WIDE_TOKENS, seed=seed)
    with KVClient(address, use_shm=False) as client:
        client.store(tokens, kv, model=WIDE)
    return tokens, kv


def test_server_killed_mid_stream_gives_unavailable_and_restarts_clean(tmp_path: Path) -> None:
    server = Sidecar(tmp_path / "data").start()
    tokens, _ = _store_wide(server.address, seed=9)
    received = 0
    with KVClient(server.address, use_shm=False) as client:
        deadline = time.monotonic() + 60  # stores are acknowledged from memory: wait for the disk
        while client.stats().counters.get("disk_backlog_blocks", 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        stream = client.load(tokens, model=WIDE)
        received += len(next(stream).positions)
        server.kill()
        assert server.proc is not None and server.proc.returncode == -signal.SIGKILL
        with pytest.raises(RpcFailedError) as info:  # the stream itself fails, nothing else
            for chunk in stream:
                received += len(chunk.positions)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert 0 < received < WIDE_TOKENS  # it died mid-stream
    assert fsck(tmp_path / "data").clean
    server.start()
    try:
        with KVClient(server.address) as client:
            assert client.lookup(tokens, model=WIDE).num_tokens == WIDE_TOKENS
    finally:
        server.kill()


def test_auth_tokens_and_namespace_grants(tmp_path: Path) -> None:
    config = tmp_path / "kvsieve.toml"
    config.write_text('[server]\nauth_tokens = { "secret-a" = ["a"], "admin" = ["*"] }\n')
    server = Sidecar(tmp_path / "data", ["--config", str(config)]).start()
    tokens, kv = make_tokens(32), make_kv(TINY, 32)
    try:
        with KVClient(server.address) as anonymous, pytest.raises(UnauthenticatedError):
            anonymous.lookup(tokens, model=TINY, namespace="a")
        with KVClient(server.address, token="wrong") as wrong, pytest.raises(UnauthenticatedError):
            wrong.lookup(tokens, model=TINY, namespace="a")
        with KVClient(server.address, token="secret-a") as tenant_a:
            tenant_a.store(tokens, kv, model=TINY, namespace="a")
            with pytest.raises(PermissionDeniedError):
                tenant_a.lookup(tokens, model=TINY, namespace="b")
            lease = tenant_a.pin(tokens, model=TINY, namespace="a")
        with KVClient(server.address, token="admin") as admin:
            assert admin.lookup(tokens, model=TINY, namespace="a").num_tokens == 32
            assert admin.lookup(tokens, model=TINY, namespace="b").num_tokens == 0
            admin.unpin(lease.lease_id)
    finally:
        server.kill()


def test_non_loopback_without_auth_is_refused(tmp_path: Path) -> None:
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "kvstore.cli.main",
        "serve",
        "--listen",
        "0.0.0.0:0",
        "--data-dir",
        str(tmp_path),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "without auth_tokens" in result.stderr


def test_malformed_streams_are_rejected_and_the_server_keeps_serving(sidecar: Sidecar) -> None:
    with grpc.insecure_channel(sidecar.address) as channel:
        stub = pb_grpc.KVCacheStub(channel)
        ctx = ctx_to_pb(TINY, "malformed")
        tokens = make_tokens(64, seed=11)
        header = pb.StoreRequest(header=pb.StoreHeader(ctx=ctx, tokens=tokens.tolist()))
        half = make_kv(TINY, 32, seed=11).tobytes()
        truncated = [
            header,
            pb.StoreRequest(slice=pb.KVSlice(start_token=0, num_tokens=32, data=half)),
        ]
        bad_order = [
            header,
            pb.StoreRequest(slice=pb.KVSlice(start_token=8, num_tokens=32, data=half)),
        ]
        no_header = [pb.StoreRequest(slice=pb.KVSlice(start_token=0, num_tokens=32, data=half))]
        short = [header, pb.StoreRequest(slice=pb.KVSlice(start_token=0, num_tokens=64, data=half))]
        for requests, text in ((truncated, "cover 32 of 64"), (bad_order, "start_token"),
                               (no_header, "header"), (short, "bytes")):  # fmt: skip
            with pytest.raises(grpc.RpcError) as info:
                stub.Store(iter(requests), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in info.value.details()
        oversized = [header, pb.StoreRequest(slice=pb.KVSlice(data=bytes(80 << 20)))]
        with pytest.raises(grpc.RpcError) as info:
            stub.Store(iter(oversized), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        missing_model = pb.LookupRequest(ctx=pb.RequestContext(namespace="x"), tokens=[1])
        with pytest.raises(grpc.RpcError) as info:
            stub.Lookup(missing_model, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "model" in info.value.details()
    with KVClient(sidecar.address) as client:
        assert client.lookup(tokens, model=TINY, namespace="malformed").num_tokens == 0
        client.store(tokens, make_kv(TINY, 64, seed=11), model=TINY, namespace="malformed")
        assert client.lookup(tokens, model=TINY, namespace="malformed").num_tokens == 64


def test_deadline_is_honoured_and_nothing_is_stored(sidecar: Sidecar) -> None:
    import time

    tokens = make_tokens(64, seed=16)

    def slow_stream():  # type: ignore[no-untyped-def]
        yield pb.StoreRequest(header=pb.StoreHeader(ctx=ctx_to_pb(TINY, "deadline"), tokens=tokens.tolist()))
        time.sleep(1.0)  # the client stalls past its own deadline
        yield pb.StoreRequest(
            slice=pb.KVSlice(start_token=0, num_tokens=64, data=make_kv(TINY, 64).tobytes())
        )

    with grpc.insecure_channel(sidecar.address) as channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.KVCacheStub(channel).Store(slow_stream(), timeout=0.3)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    with KVClient(sidecar.address) as client:
        assert client.lookup(tokens, model=TINY, namespace="deadline").num_tokens == 0


@pytest.mark.skipif(not shm.available(), reason="no memfd or /proc")
def test_shared_memory_path_is_used_and_never_leaks(tmp_path: Path) -> None:
    server = Sidecar(tmp_path / "data").start()
    assert server.proc is not None
    tokens, kv = make_tokens(32 * 20, seed=12), make_kv(TINY, 32 * 20, seed=12)
    try:
        with KVClient(server.address, use_shm=True) as client:
            client.store(tokens, kv, model=TINY)
            with client.load(tokens, model=TINY) as stream:  # normal, arena reused afterwards
                positions, gathered = stream.gather(TINY)
                assert stream.arena_view is not None  # the server wrote into the arena ...
                assert np.shares_memory(gathered, stream.arena_view)  # ... and nobody copied it out
                assert not gathered.flags.writeable  # a read-only mapping
                assert gathered.tobytes() == kv[:, :, :, positions].tobytes()
            assert len(shm.open_arenas(server.proc.pid)) == 1  # one arena, kept warm for reuse
            with client.load(tokens, model=TINY) as stream:
                list(stream)
            assert len(shm.open_arenas(server.proc.pid)) == 1  # reused, not a second one
            stream = client.load(tokens, model=TINY)  # cancelled mid-stream
            next(stream)
            stream.close()
            client.load_arrays(tokens, model=TINY)
            abandoned = client.load(tokens, model=TINY)  # never closed
            next(abandoned)
            del abandoned
        assert shm.open_arenas(server.proc.pid) == []  # close() released every arena
        assert shm.leaked_segments() == []  # and nothing ever had a name in /dev/shm
    finally:
        server.kill()


def test_health_reflection_and_metrics(sidecar: Sidecar) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(sidecar.address) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"kvsieve.v1.KVCache", "grpc.health.v1.Health"} <= services
    with KVClient(sidecar.address) as client:
        client.store(make_tokens(32, seed=13), make_kv(TINY, 32, seed=13), model=TINY, namespace="m")
        client.load_arrays(make_tokens(32, seed=13), model=TINY, namespace="m")
    body = (
        urllib.request.urlopen(f"http://127.0.0.1:{sidecar.metrics_port}/metrics", timeout=10).read().decode()
    )
    expected = (
        "kvsieve_chunk_hits_total kvsieve_load_seconds_bucket kvsieve_read_amplification_bucket"
        " kvsieve_checksum_failures_total kvsieve_active_leases kvsieve_active_streams"
        " kvsieve_evictions_total kvsieve_written_bytes_total"
    )
    for name in expected.split():
        assert name in body, name


def test_sigterm_drains_an_inflight_load_and_closes_cleanly(tmp_path: Path) -> None:
    server = Sidecar(tmp_path / "data").start()
    assert server.proc is not None
    tokens, kv = _store_wide(server.address, seed=14)
    with KVClient(server.address, use_shm=False) as client:
        stream = client.load(tokens, model=WIDE)
        chunks = [next(stream)]
        server.proc.send_signal(signal.SIGTERM)  # lands while the load is open on the server
        chunks += list(stream)  # the drain lets it finish
        assert server.proc.poll() is None or server.proc.returncode == 0
    assert len(chunks) > 1 and sum(len(c.positions) for c in chunks) == WIDE_TOKENS
    assert all(c.kv.tobytes() == kv[:, :, :, c.positions].tobytes() for c in chunks)
    _out, err = server.proc.communicate(timeout=30)
    assert server.proc.returncode == 0 and "store closed cleanly" in err
    assert fsck(tmp_path / "data").clean


def test_stats_command_against_a_server(sidecar: Sidecar) -> None:
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "kvstore.cli.main", "stats", "--target", sidecar.address, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
    figures = json.loads(out.stdout)
    assert "lmdb" in figures["tiers"] and "counters" in figures


def test_loaded_kv_moves_to_a_device_or_stays_on_cpu(sidecar: Sidecar) -> None:
    from kvstore.load.device import to_device

    tokens, kv = make_tokens(64, seed=15), make_kv(TINY, 64, seed=15)
    with KVClient(sidecar.address, use_shm=True) as client:
        client.store(tokens, kv, model=TINY, namespace="device")
        with client.load(tokens, model=TINY, namespace="device") as stream:
            _, arena_view = stream.gather(TINY)
            assert stream.arena_view is not None and np.shares_memory(arena_view, stream.arena_view)
            tensor = to_device(arena_view, "cuda")
    from kvstore.tiers.pinned import cuda_available

    assert tensor.device.type == ("cuda" if cuda_available() else "cpu")
    host = tensor.cpu().numpy()
    assert not np.shares_memory(host, arena_view)  # owns its data: valid after the arena is reused
    assert host.tobytes() == kv.tobytes()


def test_tls_serves_only_encrypted_clients(tmp_path: Path) -> None:
    import os
    import shutil
    import subprocess
    import sys
    import time

    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    address = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "kvstore.cli.main", "serve", "--listen", address, "--metrics-listen", "",
           "--data-dir", str(tmp_path / "data"), "--tls-cert", str(cert), "--tls-key", str(key),
           "--block-tokens", "32", "--chunk-tokens", "8"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ))
    try:
        tokens, kv = make_tokens(32, seed=17), make_kv(TINY, 32, seed=17)
        with KVClient(address, root_certificates=cert.read_bytes(), timeout_s=30) as client:
            for _ in range(100):  # wait for the server to come up
                try:
                    client.store(tokens, kv, model=TINY)
                    break
                except RpcFailedError:
                    time.sleep(0.1)
            assert client.lookup(tokens, model=TINY).num_tokens == 32
        with KVClient(address, timeout_s=5) as plaintext, pytest.raises(RpcFailedError):
            plaintext.lookup(tokens, model=TINY)
    finally:
        proc.kill()
        proc.wait(10)
