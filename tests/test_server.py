"""The sidecar over a real socket: contract parity with the embedded store, concurrency,
crashes, auth, errors, shared memory, health, reflection and metrics."""

from __future__ import annotations

import signal
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import TINY, make_kv, make_tokens

from bench.sidecar import Sidecar, free_port
from kvstore import shm
from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore._generated.kvsieve.v1 import kvsieve_pb2_grpc as pb_grpc
from kvstore.api import PrefixStore
from kvstore.client import KVClient, RpcFailedError
from kvstore.config import StoreConfig
from kvstore.errors import InvalidInputError, NotFoundError
from kvstore.fsck import fsck
from kvstore.model import ModelSpec
from kvstore.store import TieredStore
from kvstore.wire import PermissionDeniedError, UnauthenticatedError, ctx_to_pb


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    server = Sidecar(tmp_path_factory.mktemp("sidecar")).start()
    yield server
    server.kill()


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
    if hasattr(stream, "close"):
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
        "kvstore.cli",
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

    cmd = [sys.executable, "-m", "kvstore.cli", "stats", "--target", sidecar.address, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
    figures = json.loads(out.stdout)
    assert "lmdb" in figures["tiers"] and "counters" in figures


def test_loaded_kv_moves_to_a_device_or_stays_on_cpu(sidecar: Sidecar) -> None:
    from kvstore.device import to_device

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
    cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--listen", address, "--metrics-listen", "",
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
