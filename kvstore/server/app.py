"""`kvsieve serve`: the sidecar process around one TieredStore.

grpc.aio server with the KVCache service, standard health checking and server
reflection (so grpcurl works), message limits sized for chunks, a bound on
concurrent calls, optional TLS, and a Prometheus endpoint. SIGTERM drains
in-flight calls for `grace_s` seconds, then closes LMDB cleanly.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore._generated.kvsieve.v1 import kvsieve_pb2_grpc as pb_grpc
from kvstore.config import StoreConfig
from kvstore.events.config import medium_of
from kvstore.events.publisher import Publisher, open_publisher
from kvstore.load.buffers import keep_large_buffers
from kvstore.model import numpy_dtype
from kvstore.rpc.channel import channel_options
from kvstore.server.batch_wire import serialize_load_response
from kvstore.server.config import ServerConfig
from kvstore.server.listen import bind, check_free
from kvstore.server.metrics import EventsCollector, Metrics
from kvstore.server.servicer import KVCacheServicer
from kvstore.store.deferred import encode_on_one_thread
from kvstore.store.tiered import TieredStore

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVCache"].full_name


@dataclass
class RunningServer:
    """A started server: where it listens and how to stop it."""

    server: grpc.aio.Server
    store: TieredStore
    address: str
    metrics_address: str | None
    health: health.HealthServicer
    servicer: KVCacheServicer
    _metrics_httpd: Any = None
    _sweeper: asyncio.Task[None] | None = None
    kv_events: Publisher | None = None

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls, let in-flight ones finish for `grace_s`, then close the store."""
        self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
        self.servicer.arenas.close()
        if self.kv_events is not None:
            self.store.watch(None)
            await asyncio.to_thread(self.kv_events.close)  # publishes what is queued first
        self.store.close()


async def start(config: ServerConfig, store_config: StoreConfig) -> RunningServer:
    """Open the store and start serving. The caller stops it with `RunningServer.stop`.

    Raises:
        ListenError: an address (`listen`, `metrics_listen`) is in use: checked before the store opens.
    """
    check_free(config.listen, "--listen")
    if config.metrics_listen:
        check_free(config.metrics_listen, "--metrics-listen")
    store = TieredStore(store_config)
    try:
        kv_events = _start_kv_events(config, store)
    except BaseException:
        store.close()
        raise
    metrics = Metrics(store)
    if kv_events is not None:
        metrics.registry.register(EventsCollector(kv_events))
    server = grpc.aio.server(
        options=channel_options(config.max_message_bytes),
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
    )
    servicer = KVCacheServicer(store, config, metrics)
    add_kvcache_servicer(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:
        address = bind(server, config)
    except BaseException:  # taken since the check: nothing may stay open behind the refusal
        if kv_events is not None:
            kv_events.close()
        store.close()
        raise
    await server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    httpd, metrics_address = _start_metrics(config, metrics)
    sweeper = asyncio.create_task(_sweep_arenas(servicer))
    return RunningServer(
        server, store, address, metrics_address, health_servicer, servicer, httpd, sweeper, kv_events
    )


def _start_kv_events(config: ServerConfig, store: TieredStore) -> Publisher | None:
    """Publish KV events for routers when `kv_events` is set (an error names a bad address)."""
    events = config.events_config(medium_of(store.config.lmdb_dir is not None, store.config.has_remote))
    if events is None:
        return None
    return open_publisher(events, store.config.block_tokens, store)


async def _sweep_arenas(servicer: KVCacheServicer, every_s: float = 2.0) -> None:
    """Unmap arenas of exited clients even when no call comes to trigger a sweep."""
    while True:
        await asyncio.sleep(every_s)
        await asyncio.to_thread(servicer.arenas.sweep)


def add_kvcache_servicer(servicer: KVCacheServicer, server: grpc.aio.Server) -> None:
    """The generated registration, with Load's response serializer replaced: its batches
    arrive serialized (kvstore/server/batch_wire.py), everything else as messages."""
    captured = _CapturedHandlers()
    pb_grpc.add_KVCacheServicer_to_server(servicer, captured)
    handlers = dict(captured.handlers)
    handlers["Load"] = grpc.unary_stream_rpc_method_handler(
        servicer.Load,
        request_deserializer=pb.LoadRequest.FromString,
        response_serializer=serialize_load_response,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class _CapturedHandlers:
    """Stands in for a server to read the method handlers the generated code registers."""

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.handlers = handlers


def _start_metrics(config: ServerConfig, metrics: Metrics) -> tuple[Any, str | None]:
    if not config.metrics_listen:
        return None, None
    from prometheus_client import start_http_server

    host, _, port = config.metrics_listen.rpartition(":")
    httpd, _thread = start_http_server(int(port), addr=host or "127.0.0.1", registry=metrics.registry)
    return httpd, f"http://{host or '127.0.0.1'}:{httpd.server_port}/metrics"


async def serve_forever(config: ServerConfig, store_config: StoreConfig) -> None:
    """Run until SIGTERM or SIGINT, then drain and close."""
    keep_large_buffers()
    if store_config.layout == "layered":  # its summaries are the sidecar's only torch work
        encode_on_one_thread()
    running = await start(config, store_config)
    # Idle now: fault in memory for the first cold loads' reads (blocks read from disk after a
    # restart land there, and the memory tier keeps them), off their path.
    # The default, 128 MiB, is 2.7 loads of a 2,068-token SmolLM2 prefix (47 MB each), ~90 ms of
    # a core in the background (kvstore/tiers/disk/pread.py).
    if store_config.warm_read_ahead_bytes:
        running.store.warm_reads(store_config.warm_read_ahead_bytes)
    numpy_dtype("bfloat16")  # imports ml_dtypes now rather than in the first bfloat16 load
    print(
        f"kvsieve serving on {running.address} (data: {store_config.data_dir or 'memory only'})",
        flush=True,
    )
    if running.metrics_address:
        print(f"metrics at {running.metrics_address}", flush=True)
    if running.kv_events is not None:
        events = running.kv_events.config
        replay = f", replay on {events.replay_endpoint}" if events.replay_endpoint else ""
        shape = f"{events.medium}, blocks of {events.router_block_tokens} tokens"
        print(f"KV events on {events.endpoint}{replay} ({shape})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print(
        f"draining in-flight calls for up to {config.grace_s:.0f} s ...",
        file=sys.stderr,
        flush=True,
    )
    await running.stop(config.grace_s)
    print("stopped; store closed cleanly", file=sys.stderr, flush=True)
