"""Errors -> gRPC status codes: the one table, and an internal bug seen over a real socket."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import TINY, make_kv, make_tokens

from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore._generated.kvsieve.v1 import kvsieve_pb2_grpc as pb_grpc
from kvstore.client.kvclient import KVClient
from kvstore.config import StoreConfig
from kvstore.errors import (
    InvalidInputError,
    KVSieveError,
    NotFoundError,
    PermissionDeniedError,
    RpcFailedError,
    StoreFullError,
)
from kvstore.model import ModelSpec
from kvstore.rpc.messages import ctx_to_pb
from kvstore.rpc.status import STATUS_TABLE, error_for, status_for, status_of
from kvstore.server.config import ServerConfig
from kvstore.server.metrics import Metrics
from kvstore.server.servicer import KVCacheServicer
from kvstore.store.tiered import TieredStore
from kvstore.values import LookupResult


class BuggyStore(TieredStore):
    """A real store whose lookup hits an internal bug: a bare ValueError, not bad input."""

    def lookup(self, tokens: Any, *, model: ModelSpec, namespace: str = "default") -> LookupResult:
        raise ValueError("internal invariant broken: radix depth -1")


class BuggyServer:
    """The real servicer around `BuggyStore`, on a loopback port, its event loop in a thread."""

    def __init__(self, data_dir: Path) -> None:
        self.store = BuggyStore(StoreConfig(data_dir=data_dir, block_tokens=32, chunk_tokens=8))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server, self.address = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> tuple[Any, str]:
        server = grpc.aio.server()
        servicer = KVCacheServicer(self.store, ServerConfig(metrics_listen=""), Metrics(self.store))
        pb_grpc.add_KVCacheServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, f"127.0.0.1:{port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(1), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        assert not self.thread.is_alive()
        self.store.close()


@pytest.fixture
def buggy(tmp_path: Path) -> Iterator[BuggyServer]:
    server = BuggyServer(tmp_path / "data")
    yield server
    server.close()


def test_an_internal_bug_reaches_the_client_as_internal_and_is_logged(
    buggy: BuggyServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="kvsieve.server")
    tokens = make_tokens(64, seed=1)
    with KVClient(buggy.address, use_shm=False) as client:
        client.store(tokens, make_kv(TINY, 64, seed=1), model=TINY)  # the rest of the store works
        with pytest.raises(RpcFailedError) as info:
            client.lookup(tokens, model=TINY)
    assert info.value.code == grpc.StatusCode.INTERNAL
    assert not isinstance(info.value, InvalidInputError)
    assert "ValueError" in str(info.value)
    logged = [r for r in caplog.records if r.name == "kvsieve.server" and r.exc_info]
    assert logged and "radix depth -1" in logged[0].getMessage()


def test_bad_input_over_the_same_socket_is_still_invalid_argument(buggy: BuggyServer) -> None:
    with grpc.insecure_channel(buggy.address) as channel:
        stub = pb_grpc.KVCacheStub(channel)
        ctx = ctx_to_pb(TINY, "default")
        ctx.model.name = ""  # the model is required
        with pytest.raises(grpc.RpcError) as info:
            stub.Pin(pb.PinRequest(ctx=ctx, tokens=[1, 2, 3]), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ctx.model is required" in (info.value.details() or "")


def test_only_the_error_family_is_in_the_table() -> None:
    assert all(issubclass(cls, KVSieveError) for cls, _ in STATUS_TABLE)
    assert status_for(ValueError("bug")) == grpc.StatusCode.INTERNAL
    assert status_for(KeyError("bug")) == grpc.StatusCode.INTERNAL
    assert status_for(InvalidInputError("tokens: bad")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(InvalidInputError("tokens: bad")).details == "tokens: bad"
    assert status_of(RuntimeError("boom")).details == "internal error: RuntimeError: boom"


@pytest.mark.parametrize(
    "error", [InvalidInputError("x"), StoreFullError("x"), NotFoundError("x"), PermissionDeniedError("x")]
)
def test_the_client_maps_a_status_back_to_the_same_class(error: KVSieveError) -> None:
    back = error_for(status_for(error), str(error))
    assert type(back) is type(error) and str(back) == "x"


def test_codes_without_a_domain_error_stay_rpc_failures() -> None:
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED):
        back = error_for(code, "gone")
        assert isinstance(back, RpcFailedError) and back.code == code
