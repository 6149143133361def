"""Fuzzing raw gRPC requests against a real in-process `kvsieve serve` on loopback.

Every field of every request gets random and hostile values (huge counts, NaN,
odd strings, wrong tokens, bad slices). The server must answer each with a
well-defined status (never INTERNAL or UNKNOWN, never a hang) and stay alive.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import ServerInThread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore._generated.kvsieve.v1 import kvsieve_pb2_grpc as pb_grpc
from kvstore.config import StoreConfig
from kvstore.server.config import ServerConfig

FUZZ = settings(
    max_examples=int(os.environ.get("KVSIEVE_FUZZ_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
# Statuses a client can act on. INTERNAL/UNKNOWN mean an unhandled exception;
# DEADLINE_EXCEEDED a hang; UNAVAILABLE a dead server.
WELL_DEFINED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.DATA_LOSS,
}
TOKENS = {"tok-a": ["ns-a"], "admin": ["*"]}
TINY = pb.ModelSpec(name="test-tiny", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float16")

U32 = st.one_of(
    st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2, 7, 8, 31, 32, 33, 64, 2**16, 2**31, 2**32 - 1])
)
TEXT = st.one_of(
    st.text(max_size=24),
    st.sampled_from(
        ["", "*", "default", "ns-a", "../../etc/passwd", "\x00", "x" * 300, "kvsieve-1-0123456789abcdef"]
    ),
)
FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
DOUBLE = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -1.0, 1e-9, 1e300]))
TOKEN_LISTS = st.one_of(
    st.lists(U32, max_size=80),
    st.integers(1, 4).map(lambda n: list(range(32 * n))),  # block-aligned prefixes that a Store may hit
)
METADATA = st.sampled_from(["", "Bearer tok-a", "Bearer admin", "Bearer nope", "Basic tok-a", "Bearer "]).map(
    lambda header: (("authorization", header),) if header else ()
)


@st.composite
def model_specs(draw: Any) -> pb.ModelSpec:
    if draw(st.booleans()):
        return TINY
    return pb.ModelSpec(
        name=draw(TEXT), num_layers=draw(U32), num_kv_heads=draw(U32), head_dim=draw(U32),
        dtype=draw(st.sampled_from(["", "float16", "bfloat16", "float32", "int8", "garbage"])),
        rope=draw(TEXT), weights_digest=draw(TEXT), tokenizer_digest=draw(TEXT),
    )  # fmt: skip


@st.composite
def contexts(draw: Any) -> pb.RequestContext:
    namespace = draw(st.one_of(TEXT, st.sampled_from(["ns-a", "ns-b", ""])))
    return pb.RequestContext(namespace=namespace, model=draw(model_specs()))


@st.composite
def store_streams(draw: Any) -> list[pb.StoreRequest]:
    header = pb.StoreHeader(
        ctx=draw(contexts()), tokens=draw(TOKEN_LISTS), scores=draw(st.lists(FLOAT32, max_size=40)),
        kv_start=draw(st.one_of(U32, st.sampled_from([0, 32]))),
    )  # fmt: skip
    token_bytes = 2 * 2 * 2 * 4 * 2  # TINY: layers * K/V * heads * dim * fp16
    slices = [
        pb.StoreRequest(
            slice=pb.KVSlice(
                start_token=draw(st.one_of(U32, st.just(32 * i))),
                num_tokens=(n := draw(st.one_of(U32, st.sampled_from([32, 64])))),
                data=draw(st.one_of(st.binary(max_size=64), st.just(b"\x01" * token_bytes * min(n, 128)))),
            )
        )
        for i in range(draw(st.integers(0, 3)))
    ]
    first = draw(st.sampled_from(["header", "slice", "none"]))
    if first == "none":
        return slices
    if first == "slice":
        return [pb.StoreRequest(slice=pb.KVSlice(num_tokens=1)), pb.StoreRequest(header=header), *slices]
    extra = [pb.StoreRequest(header=header)] if draw(st.booleans()) else []
    return [pb.StoreRequest(header=header), *slices, *extra]


REQUESTS = st.one_of(
    st.builds(lambda c, t: ("Lookup", pb.LookupRequest(ctx=c, tokens=t)), contexts(), TOKEN_LISTS),
    st.builds(lambda s: ("Store", s), store_streams()),
    st.builds(
        lambda c, t, b, bt, name, size: ("Load", pb.LoadRequest(
            ctx=c, tokens=t, budget=b, budget_tokens=bt, shm_name=name, shm_bytes=size)),
        contexts(), TOKEN_LISTS, FLOAT32, U32, TEXT, st.one_of(U32, st.integers(0, 2**64 - 1)),
    ),
    st.builds(
        lambda c, t, s, src: ("ReportScores", pb.ReportScoresRequest(ctx=c, tokens=t, scores=s, source=src)),
        contexts(), TOKEN_LISTS, st.lists(FLOAT32, max_size=130), TEXT,
    ),
    st.builds(
        lambda c, t, ttl: ("Pin", pb.PinRequest(ctx=c, tokens=t, ttl_s=ttl)), contexts(), TOKEN_LISTS, DOUBLE
    ),
    st.builds(lambda lease: ("Unpin", pb.UnpinRequest(lease_id=lease)), TEXT),
    st.just(("Stats", pb.StatsRequest())),
    st.builds(lambda name: ("ReleaseSegment", pb.ReleaseSegmentRequest(shm_name=name)), TEXT),
)  # fmt: skip


class ServerThread:
    """`kvsieve serve` (kvstore.server.app.start) on a free loopback port, its loop in a thread."""

    def __init__(self, data_dir: Path) -> None:
        from kvstore.server.app import start

        config = ServerConfig(listen="127.0.0.1:0", metrics_listen="", auth_tokens=TOKENS)
        store_config = StoreConfig(data_dir=data_dir, block_tokens=32, chunk_tokens=8, memory_bytes=16 << 20)
        self.server = ServerInThread(start(config, store_config))
        self.channel = grpc.insecure_channel(self.server.address)
        self.stub = pb_grpc.KVCacheStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.server.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    running = ServerThread(tmp_path_factory.mktemp("fuzz") / "data")
    yield running
    running.close()


def _call(server: ServerThread, method: str, request: Any, metadata: Any) -> grpc.StatusCode:
    rpc = getattr(server.stub, method)
    try:
        if method == "Store":
            rpc(iter(request), metadata=metadata, timeout=20)
        elif method == "Load":
            for _ in rpc(request, metadata=metadata, timeout=20):
                pass
        else:
            rpc(request, metadata=metadata, timeout=20)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK, ""


def _alive(server: ServerThread) -> bool:
    reply = server.stub.Lookup(
        pb.LookupRequest(ctx=pb.RequestContext(namespace="ns-a", model=TINY), tokens=list(range(64))),
        metadata=(("authorization", "Bearer tok-a"),), timeout=10,
    )  # fmt: skip
    return reply.num_tokens % 32 == 0


@FUZZ
@given(REQUESTS, METADATA)
def test_garbage_in_every_field_gets_a_well_defined_status(
    server: ServerThread, call: Any, metadata: Any
) -> None:
    method, request = call
    code, details = _call(server, method, request, metadata)
    assert code in WELL_DEFINED, f"{method} -> {code.name}: {details}\nrequest: {request}"
    assert _alive(server)


def test_the_fuzzer_reaches_the_deep_paths(server: ServerThread) -> None:
    """A valid store and load through the same server: garbage is refused, not everything."""
    token = (("authorization", "Bearer tok-a"),)
    ctx = pb.RequestContext(namespace="ns-a", model=TINY)
    data = b"\x01" * (2 * 2 * 2 * 4 * 2) * 64
    header = pb.StoreRequest(header=pb.StoreHeader(ctx=ctx, tokens=list(range(1000, 1064))))
    part = pb.StoreRequest(slice=pb.KVSlice(start_token=0, num_tokens=64, data=data))
    assert server.stub.Store(iter([header, part]), metadata=token, timeout=20).new_blocks == 2
    load = pb.LoadRequest(ctx=ctx, tokens=list(range(1000, 1064)))
    replies = list(server.stub.Load(load, metadata=token, timeout=20))
    chunks = [r for r in replies if r.WhichOneof("part") == "batch"]
    assert sum(len(c.data) for r in chunks for c in r.batch.chunks) == len(data)


# Valid-looking model specs whose KV for a few tokens needs terabytes.
HUGE_SPECS = st.builds(
    lambda layers, heads, dim: pb.ModelSpec(
        name="huge", num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype="float32"
    ),
    st.integers(1, 65535), st.sampled_from([8, 1024, 4096, 65535]), st.sampled_from([64, 4096, 65535]),
)  # fmt: skip


@FUZZ
@given(HUGE_SPECS, st.integers(1, 4))
def test_huge_but_valid_model_specs_are_refused_before_allocation(
    server: ServerThread, spec: Any, blocks: int
) -> None:
    header = pb.StoreHeader(
        ctx=pb.RequestContext(namespace="ns-a", model=spec), tokens=list(range(32 * blocks))
    )
    token = (("authorization", "Bearer tok-a"),)
    code, details = _call(server, "Store", [pb.StoreRequest(header=header)], token)
    assert code in WELL_DEFINED, f"Store -> {code.name}: {details}\nheader: {header}"
    assert _alive(server)
