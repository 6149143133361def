"""Streams against a real `kvsieve serve`: no client can hold a stream, a pin or the in-flight
budget by going quiet, and no tenant can take the server's call slots from the others.

Each test does the hostile thing for real over loopback (a client that sends reads and never
reads the answers, a Store that declares its bytes and sends nothing, a tenant that opens many
streams), then checks what users see: the status the offender gets, its pin and bytes released,
and the other tenant served within a second.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from threading import Thread
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import TINY, make_kv, make_tokens
from hostile import auth_sidecar, bearer, raw_stub, wait_until

from bench.common.sidecar import Sidecar
from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore._generated.kvsieve.v1 import kvsieve_pb2_grpc as pb_grpc
from kvstore.client.kvclient import KVClient
from kvstore.errors import InvalidInputError, StoreFullError
from kvstore.model import ModelSpec
from kvstore.rpc.messages import ctx_to_pb
from kvstore.server.config import ServerConfig

B, C = 32, 8  # the test sidecar's block tokens; per-layer chunk tokens
# 4 KiB per token and layer: a read of 512 tokens of one layer is a 2 MiB answer.
WIDE = ModelSpec("test-wide", num_layers=2, num_kv_heads=8, head_dim=128)
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
Array = np.ndarray[Any, Any]


def _sidecar(tmp_path: Path, *args: str) -> Sidecar:
    """Auth on (tok-a: a, tok-b: b), layered, idle limits of 1 s, 16 MiB Stores."""
    return auth_sidecar(
        tmp_path, "--layout", "layered", "--layers-idle-s", "1", "--stream-idle-s", "1",
        "--max-store-bytes", "16MiB", "--max-inflight-store-bytes", "32MiB", *args,
    )  # fmt: skip


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Sidecar]:
    sidecar = _sidecar(tmp_path)
    yield sidecar
    sidecar.kill()


def _metric(server: Sidecar, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read()
    return next(float(line.split()[1]) for line in body.decode().splitlines() if line.startswith(name + " "))


def _store(server: Sidecar, model: ModelSpec, num_tokens: int, seed: int) -> Array:
    """Store a prefix as tenant a; returns its tokens."""
    tokens = make_tokens(num_tokens, seed=seed)
    with KVClient(server.address, token="tok-a", use_shm=False) as a:
        a.store(tokens, make_kv(model, num_tokens, seed=seed), model=model, namespace="a")
    return tokens


def _timed(call: Callable[[], object]) -> object:
    """`call`'s result; it must come within a second (a bound on being served, not a benchmark)."""
    started = time.monotonic()
    result = call()
    assert time.monotonic() - started < 1.0
    return result


def _b_is_served(server: Sidecar) -> None:
    """Tenant b's Lookup, Store and Load each answer within a second."""
    tokens, kv = make_tokens(2 * B, seed=77), make_kv(TINY, 2 * B, seed=77)
    with KVClient(server.address, token="tok-b", use_shm=False) as b:
        _timed(lambda: b.store(tokens, kv, model=TINY, namespace="b"))
        assert _timed(lambda: b.lookup(tokens, model=TINY, namespace="b")).num_tokens == 2 * B  # type: ignore[attr-defined]
        covered, _, loaded = _timed(lambda: b.load_arrays(tokens, model=TINY, namespace="b"))  # type: ignore[misc]
        assert covered == 2 * B and np.array_equal(loaded, kv)


class Silent:
    """A request stream that sends `first` and then nothing until released (never half-closes)."""

    def __init__(self, *first: Any) -> None:
        self.first = first
        self.release = threading.Event()

    def __iter__(self) -> Iterator[Any]:
        yield from self.first
        self.release.wait(60)


@contextmanager
def _unread_stub(address: str) -> Iterator[pb_grpc.KVCacheStub]:
    """A stub whose flow-control window stays at grpc's 64 KiB (no BDP probing): what a client
    that does not read leaves the server is bounded, so its sends block early."""
    with grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        yield pb_grpc.KVCacheStub(channel)


def _status(call: Any) -> tuple[grpc.StatusCode, str]:
    """Read a call to its end: its status code and details."""
    try:
        for _ in call:
            pass
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def test_a_layers_client_that_stops_reading_loses_its_stream_and_its_pin(server: Sidecar) -> None:
    tokens = _store(server, WIDE, 1024, seed=1)
    opening = pb.LayersOpen(ctx=ctx_to_pb(WIDE, "a"), tokens_u32le=tokens.astype("<u4").tobytes())
    halves = [np.arange(64, dtype="<u4").tobytes(), np.arange(64, 128, dtype="<u4").tobytes()]
    reads = [
        pb.LayersRequest(read=pb.LayerRead(layer=i % 2, chunks_u32le=halves[i // 2 % 2])) for i in range(64)
    ]
    requests = Silent(pb.LayersRequest(open=opening), *reads)  # 128 MiB of answers asked for
    with _unread_stub(server.address) as stub, KVClient(server.address, token="tok-a") as a:
        call = stub.LoadLayers(iter(requests), metadata=bearer("tok-a"), timeout=60)  # never read
        assert wait_until(lambda: a.stats().active_leases == 1)  # the stream's pin, counted as a's
        pinned = time.monotonic()
        assert wait_until(lambda: a.stats().active_leases == 0, timeout_s=10)  # released by the server
        assert time.monotonic() - pinned > 0.5  # at the idle limit, not before
        _b_is_served(server)
        requests.release.set()
        code, details = _status(call)
    assert code == EXHAUSTED and "took no answer for 1 s (layers_idle_s)" in details


def test_a_load_client_that_stops_reading_loses_its_stream(server: Sidecar) -> None:
    tokens = _store(server, WIDE, 2048, seed=2)  # 16 MiB of KV to send
    request = pb.LoadRequest(ctx=ctx_to_pb(WIDE, "a"), tokens_u32le=tokens.astype("<u4").tobytes())
    with _unread_stub(server.address) as stub:
        call = stub.Load(request, metadata=bearer("tok-a"), timeout=60)  # never read
        time.sleep(1.5)  # past stream_idle_s = 1 of this sidecar
        _b_is_served(server)
        code, details = _status(call)
    assert code == EXHAUSTED and "took no answer for 1 s (stream_idle_s)" in details


def test_a_store_that_sends_nothing_loses_its_stream_and_its_bytes(server: Sidecar) -> None:
    header = pb.StoreHeader(ctx=ctx_to_pb(WIDE, "a"), tokens=make_tokens(2048, seed=3).tolist())
    silent = [Silent(pb.StoreRequest(header=header)), Silent()]  # no slice; not even a header
    with raw_stub(server.address) as stub:
        calls = [stub.Store.future(iter(s), metadata=bearer("tok-a"), timeout=60) for s in silent]
        assert wait_until(lambda: _metric(server, "kvsieve_inflight_store_bytes") == 16 << 20)
        errors = [call.exception(timeout=10) for call in calls]
    assert [e.code() for e in errors] == [EXHAUSTED, EXHAUSTED]  # type: ignore[union-attr]
    assert "no slice for 1 s (stream_idle_s)" in errors[0].details()  # type: ignore[union-attr]
    assert "no header for 1 s (stream_idle_s)" in errors[1].details()  # type: ignore[union-attr]
    assert _metric(server, "kvsieve_inflight_store_bytes") == 0
    for s in silent:
        s.release.set()


def test_silent_stores_of_one_tenant_hold_only_its_share_of_the_inflight_bytes(server: Sidecar) -> None:
    header = pb.StoreHeader(ctx=ctx_to_pb(WIDE, "a"), tokens=make_tokens(2048, seed=4).tolist())
    held = Silent(pb.StoreRequest(header=header))  # 16 MiB declared: a's whole share
    with raw_stub(server.address) as stub:
        first = stub.Store.future(iter(held), metadata=bearer("tok-a"), timeout=60)
        assert wait_until(lambda: _metric(server, "kvsieve_inflight_store_bytes") == 16 << 20)
        with pytest.raises(grpc.RpcError) as info:  # a second one: refused to a only
            stub.Store(iter([pb.StoreRequest(header=header)]), metadata=bearer("tok-a"), timeout=10)
        assert info.value.code() == EXHAUSTED
        assert "namespace_max_inflight_bytes=16777216" in (info.value.details() or "")
        _b_is_served(server)
        error = first.exception(timeout=10)  # and the held one ends at stream_idle_s
        held.release.set()
    assert error is not None and error.code() == EXHAUSTED and "stream_idle_s" in error.details()
    assert _metric(server, "kvsieve_inflight_store_bytes") == 0


def _keep_alive(stub: Any, opening: pb.LayersOpen, stop: threading.Event, out: list[Any]) -> None:
    """A greedy but well-behaved LoadLayers client: `open`, then a summary read every 0.3 s."""

    def requests() -> Iterator[pb.LayersRequest]:
        yield pb.LayersRequest(open=opening)
        while not stop.wait(0.3):
            yield pb.LayersRequest(read=pb.LayerRead(layer=0, summary=True))

    answers = 0
    try:
        for _ in stub.LoadLayers(requests(), metadata=bearer("tok-a"), timeout=60):
            answers += 1
        out.append(("ended", answers))
    except grpc.RpcError as exc:
        out.append((exc.code(), exc.details()))


def test_one_tenant_with_many_streams_locks_out_only_itself(tmp_path: Path) -> None:
    server = _sidecar(tmp_path, "--max-concurrent-rpcs", "8")  # a tenant may hold 8 // 4 = 2 streams
    try:
        tokens = _store(server, TINY, 3 * B, seed=5)
        opening = pb.LayersOpen(ctx=ctx_to_pb(TINY, "a"), tokens_u32le=tokens.astype("<u4").tobytes())
        stop, out = threading.Event(), []
        with raw_stub(server.address) as stub:
            threads = [Thread(target=_keep_alive, args=(stub, opening, stop, out)) for _ in range(8)]
            for thread in threads:
                thread.start()
            assert wait_until(lambda: len(out) == 6, timeout_s=10)  # all 8 grpc slots were asked for
            assert all(code == EXHAUSTED and "namespace_max_streams" in details for code, details in out)
            time.sleep(1.5)  # the two admitted streams live on past layers_idle_s: they keep reading
            assert len(out) == 6
            for _ in range(3):
                _b_is_served(server)
            stop.set()
            for thread in threads:
                thread.join(10)
                assert not thread.is_alive()
        ended = [answers for status, answers in out if status == "ended"]
        assert len(ended) == 2 and all(answers >= 5 for answers in ended)  # header + summaries
    finally:
        server.kill()


def _opens(a: KVClient) -> bool:
    """Whether a LoadLayers stream of tenant a is admitted now."""
    try:
        with a.open_layers(make_tokens(B), model=TINY, namespace="a") as load:
            return load.matched_tokens == 0
    except StoreFullError:
        return False


def test_streams_that_never_open_count_from_the_token_and_end_at_the_idle_limit(tmp_path: Path) -> None:
    server = _sidecar(tmp_path, "--namespace-max-streams", "2")
    try:
        with raw_stub(server.address) as stub:
            silent = [Silent(), Silent()]  # not even `open`
            calls = [stub.LoadLayers(iter(s), metadata=bearer("tok-a"), timeout=60) for s in silent]
            time.sleep(0.3)
            third = stub.LoadLayers(iter([]), metadata=bearer("tok-a"), timeout=10)
            code, details = _status(third)
            assert code == EXHAUSTED and "has 2 streams open, the most namespace_max_streams" in details
            _b_is_served(server)
            statuses = [_status(call) for call in calls]
            for s in silent:
                s.release.set()
        idle = "LoadLayers: no request for 1 s (layers_idle_s); the load was released"
        assert statuses == [(EXHAUSTED, idle)] * 2
        with KVClient(server.address, token="tok-a") as a:  # a's slots are free again
            assert wait_until(lambda: _opens(a))
    finally:
        server.kill()


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"stream_idle_s": 0.0}, "stream_idle_s must be in (0, 3600], got 0.0"),
        ({"namespace_max_streams": 64}, "namespace_max_streams must be 0"),
        ({"namespace_max_inflight_bytes": 1 << 20}, "namespace_max_inflight_bytes must be 0"),
    ],
)
def test_tenant_shares_that_leave_no_room_for_others_are_refused(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        ServerConfig(metrics_listen="", **fields)
    assert named in str(info.value)
    defaults = ServerConfig(metrics_listen="")
    assert (defaults.streams_per_tenant, defaults.inflight_bytes_per_tenant) == (16, 1 << 30)
