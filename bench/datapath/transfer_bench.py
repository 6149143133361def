"""`kvsieve bench transfer`: moving a 2,048-token SmolLM2-shaped prefix (47 MB) to a client.

Measured in one run against a real `kvsieve serve` process on loopback:
the gRPC stream, the shared-memory path, a plain loopback TCP socket sending the
same bytes, and memcpy. Every path places the KV into a preallocated array, as
an engine does. Lookup latency is taken with 8 concurrent clients. A restarted
sidecar's first loads, from the page cache, are bench/datapath/restart_fetch.py's.
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.common.sidecar import Sidecar
from bench.datapath import grpc_floor
from bench.datapath.disk_write import write_behind_vs_sequential
from bench.datapath.restart_fetch import restart_fetch
from bench.datapath.store_bench import SMOLLM2_SHAPE
from kvstore.client.kvclient import KVClient
from kvstore.load.assemble import place_chunks
from kvstore.load.buffers import keep_large_buffers
from kvstore.rpc.channel import channel_options

MODEL = SMOLLM2_SHAPE


def run(quick: bool = False) -> dict[str, Any]:
    """Run the benchmark; returns the JSON object `kvsieve bench transfer --json` prints."""
    keep_large_buffers()
    num_tokens = 512 if quick else 2048
    repeats = 3 if quick else 7
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 49152, num_tokens)
    kv = rng.standard_normal(MODEL.kv_shape(num_tokens)).astype(np.float16)
    out = np.ones_like(kv)  # resident, as an engine's cache is
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        server = _start_server(Path(tmp))
        synced = _start_server(Path(tmp) / "sync", "--sync-stores")  # stores as before write-behind
        try:
            result = _measure(server, tokens, kv, out, repeats, quick)
            result |= _sync_stores(server, synced, kv, repeats)
        finally:
            server.kill()
            synced.kill()
        result |= write_behind_vs_sequential(Path(tmp), MODEL, kv, 2 if quick else 4, 1 if quick else 3)
        result |= restart_fetch(
            Path(tmp) / "restart", MODEL, num_tokens, 3 if quick else 5, 1 if quick else 3
        )
    result["raw_tcp_mb_s"] = round(_tcp_mb_s(kv.nbytes, repeats), 1)
    result["grpc_floor_mb_s"] = round(_grpc_floor_mb_s(kv.nbytes, repeats), 1)
    result["grpc_vs_floor"] = round(result["grpc_stream_mb_s"] / result["grpc_floor_mb_s"], 3)
    result["memcpy_mb_s"] = round(_memcpy_mb_s(kv, out, repeats), 1)
    result["grpc_vs_tcp"] = round(result["grpc_stream_mb_s"] / result["raw_tcp_mb_s"], 3)
    result["shm_vs_memcpy"] = round(result["shm_mb_s"] / result["memcpy_mb_s"], 3)
    return {"prefix_tokens": num_tokens, "prefix_bytes": kv.nbytes, **result}


def _start_server(data_dir: Path, *extra: str) -> Sidecar:
    # The store's default geometry (256-token blocks, 16-token chunks), not the small one tests use.
    return Sidecar(
        data_dir, ["--metrics-listen", "", "--block-tokens", "256", "--chunk-tokens", "16", *extra]
    ).start()


def _sync_stores(server: Sidecar, synced: Sidecar, kv: Any, repeats: int) -> dict[str, float]:
    """Stores through shared memory, acknowledged from memory (write-behind, the default) and
    synchronous (`--sync-stores`), interleaved on the same machine in the same run."""
    behind_s: list[float] = []
    sync_s: list[float] = []
    with KVClient(server.address, use_shm=True) as behind, KVClient(synced.address, use_shm=True) as sync:
        for client in (behind, sync):  # the first store through an arena maps it (not timed)
            client.store(np.arange(kv.shape[3]) + 70_000, kv, model=MODEL)
        for i in range(repeats):
            for client, times in ((behind, behind_s), (sync, sync_s)):
                tokens = np.random.default_rng(5000 + i).integers(0, 49152, kv.shape[3])
                t0 = time.perf_counter()
                client.store(tokens, kv, model=MODEL)
                times.append(time.perf_counter() - t0)
    settled = _settled_stores(server, kv, repeats)
    return {
        "store_shm_ack_mb_s": round(kv.nbytes / statistics.median(settled) / 1e6, 1),
        "store_shm_write_behind_mb_s": round(kv.nbytes / statistics.median(behind_s) / 1e6, 1),
        "store_shm_sync_mb_s": round(kv.nbytes / statistics.median(sync_s) / 1e6, 1),
        "store_shm_vs_sync": round(statistics.median(sync_s) / statistics.median(behind_s), 3),
    }


def _settled_stores(server: Sidecar, kv: Any, repeats: int) -> list[float]:
    """Seconds per Store through shared memory while the disk keeps up: each waits (untimed) for
    the write-behind backlog to drain first, so the acknowledgement alone is timed. Back to back,
    Stores beyond `disk_backlog_bytes` wait for the writer instead (`store_shm_mb_s`)."""
    seconds: list[float] = []
    with KVClient(server.address, use_shm=True) as client:
        for i in range(repeats):
            deadline = time.monotonic() + 300
            while client.stats().counters.get("disk_backlog_blocks", 0):
                if time.monotonic() > deadline:
                    raise RuntimeError("the sidecar's disk backlog did not drain in 300 s")
                time.sleep(0.01)
            tokens = np.random.default_rng(9000 + i).integers(0, 49152, kv.shape[3])
            t0 = time.perf_counter()
            client.store(tokens, kv, model=MODEL)
            seconds.append(time.perf_counter() - t0)
    return seconds


def _measure(server: Any, tokens: Any, kv: Any, out: Any, repeats: int, quick: bool) -> dict[str, Any]:
    with (
        KVClient(server.address, use_shm=False) as plain,
        KVClient(server.address, use_shm=True) as shm,
    ):
        plain.store(tokens, kv, model=MODEL)
        _load_into(plain, tokens, out)  # promote into the memory tier
        if out.tobytes() != kv.tobytes():
            raise RuntimeError("loaded KV differs from stored KV")
        grpc_s = [_load_into(plain, tokens, out) for _ in range(repeats)]
        shm_s = [_load_shared(shm, tokens, kv) for _ in range(repeats + 1)][1:]  # 1st maps the arena
        per_client = 200 if quick else 1000
        p50, p99 = _concurrent_calls(
            lambda: KVClient(server.address), lambda c: c.lookup(tokens, model=MODEL), per_client
        )
        floor50, floor99 = _concurrent_calls(
            lambda: _HealthClient(server.address), _HealthClient.check, per_client
        )
        store_grpc, store_shm = _stores(plain, shm, kv, repeats)
    return {
        "store_grpc_mb_s": round(kv.nbytes / statistics.median(store_grpc) / 1e6, 1),
        "store_shm_mb_s": round(kv.nbytes / statistics.median(store_shm) / 1e6, 1),
        "store_shm_vs_grpc": round(statistics.median(store_grpc) / statistics.median(store_shm), 3),
        "grpc_stream_mb_s": round(kv.nbytes / statistics.median(grpc_s) / 1e6, 1),
        "shm_mb_s": round(kv.nbytes / statistics.median(shm_s) / 1e6, 1),
        "lookup_p50_us": round(p50, 1),
        "lookup_p99_us": round(p99, 1),
        "lookup_p50_ms": round(p50 / 1e3, 3),
        "lookup_p99_ms": round(p99 / 1e3, 3),
        "lookup_clients": 8,
        "unary_floor_p50_ms": round(floor50 / 1e3, 3),
        "unary_floor_p99_ms": round(floor99 / 1e3, 3),
        "lookup_vs_unary_floor": round(p50 / floor50, 3),
    }


def _stores(plain: KVClient, shm: KVClient, kv: Any, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds per Store of new prefixes (every block new), inline slices and through an arena,
    interleaved so that both see the same machine; the first shm store maps its arena (not timed)."""
    shm.store(np.arange(kv.shape[3]) + 60_000, kv, model=MODEL)
    inline: list[float] = []
    shared: list[float] = []
    for i in range(repeats):
        for client, times in ((plain, inline), (shm, shared)):
            tokens = np.random.default_rng(1000 + 2 * i + (times is shared)).integers(0, 49152, kv.shape[3])
            t0 = time.perf_counter()
            client.store(tokens, kv, model=MODEL)
            times.append(time.perf_counter() - t0)
    return inline, shared


def _load_into(client: KVClient, tokens: Any, out: Any) -> float:
    """Seconds to load the prefix and place every chunk at its positions in `out`."""
    t0 = time.perf_counter()
    with client.load(tokens, model=MODEL) as stream:
        place_chunks(stream, out, at_positions=True)
    return time.perf_counter() - t0


def _load_shared(client: KVClient, tokens: Any, expected: Any) -> float:
    """Seconds until the whole prefix lies in the client's arena as one (L, 2, H, T, D) array.

    The server writes each chunk straight into its final place in the arena, so
    the array is ready with no copy on the client: the arena is the preallocated
    destination that the other paths copy into.
    """
    t0 = time.perf_counter()
    with client.load(tokens, model=MODEL) as stream:
        positions, kv = stream.gather(MODEL)
        elapsed = time.perf_counter() - t0
        if positions.tolist() != list(range(len(tokens))) or kv.tobytes() != expected.tobytes():
            raise RuntimeError("shared-memory load differs from stored KV")
    return elapsed


def _concurrent_calls(
    open_client: Callable[[], Any], call: Callable[[Any], object], per_client: int
) -> tuple[float, float]:
    """p50 and p99 microseconds of `call`, made by 8 clients (threads) at once."""
    samples: list[float] = []
    lock = threading.Lock()

    def worker() -> None:
        local = []
        with open_client() as client:
            for _ in range(per_client):
                t0 = time.perf_counter()
                call(client)
                local.append((time.perf_counter() - t0) * 1e6)
        with lock:
            samples.extend(local)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    samples.sort()
    return samples[len(samples) // 2], samples[int(len(samples) * 0.99)]


class _HealthClient:
    """grpc's health check on the sidecar: the cheapest call it answers (no store work), so
    the floor under any unary call, lookups included, from the same clients and server."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address)
        self._stub = health_pb2_grpc.HealthStub(self._channel)

    def check(self) -> None:
        self._stub.Check(health_pb2.HealthCheckRequest())

    def __enter__(self) -> _HealthClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self._channel.close()


def _grpc_floor_mb_s(nbytes: int, repeats: int) -> float:
    """MB/s of a bare gRPC stream (bench/datapath/grpc_floor.py, its own process) carrying `nbytes` in
    messages of one SmolLM2 block each, as the Load stream batches them."""
    size = 16 * MODEL.token_bytes * 16  # 16 chunks of 16 tokens: one block per message
    count = max(1, nbytes // size)
    proc = subprocess.Popen(
        [sys.executable, "-m", grpc_floor.__name__, str(size), str(count)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline().split()[1])
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options(64 << 20)) as channel:
            stream = channel.unary_stream(grpc_floor.METHOD)
            sum(len(m) for m in stream(b""))  # connect and warm up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                received = sum(len(m) for m in stream(b""))
                times.append(time.perf_counter() - t0)
    finally:
        proc.kill()
        proc.wait()
    return received / statistics.median(times) / 1e6


def _tcp_mb_s(nbytes: int, repeats: int) -> float:
    """A plain loopback socket: one thread sends `nbytes`, the caller receives into a buffer."""
    payload = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8).tobytes()
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def sender() -> None:
        conn, _ = server.accept()
        with conn:
            for _ in range(repeats):
                conn.sendall(payload)

    thread = threading.Thread(target=sender)
    thread.start()
    buf = memoryview(bytearray(nbytes))
    times = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for _ in range(repeats):
            t0 = time.perf_counter()
            got = 0
            while got < nbytes:
                got += sock.recv_into(buf[got:], nbytes - got)
            times.append(time.perf_counter() - t0)
    thread.join()
    server.close()
    return nbytes / statistics.median(times) / 1e6


def _memcpy_mb_s(src: Any, dst: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return float(src.nbytes / statistics.median(times) / 1e6)
