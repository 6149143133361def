"""`kvsieve bench events`, the replay flood: what a client flooding the KV-event replay socket
costs every other client's stores (issue #40 item 6; the keys are described in events_bench.py).

A real `kvsieve serve --kv-events --kv-events-replay` on loopback; Stores of one block through
KVClient, one at a time (8 KB blocks in the importance layout, as the throughput keys: the
cheaper a Store, the more a flood's cost weighs): quiet, then while another process asks the
replay socket for sequence 0 as fast as its socket takes requests and never reads an answer,
then after it was killed.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from bench.common.sidecar import Sidecar, free_port
from kvstore.client.kvclient import KVClient
from kvstore.model import ModelSpec

MODEL = ModelSpec("bench-events", num_layers=2, num_kv_heads=2, head_dim=8)
BLOCK = 256
#: Run by the flooding process: says "stalled" once its socket stopped taking requests; stops
#: when the benchmark that started it is gone.
FLOODER = """
import os, sys, zmq
parent = int(sys.argv[2])
dealer = zmq.Context().socket(zmq.DEALER)
dealer.setsockopt(zmq.LINGER, 0)
dealer.setsockopt(zmq.SNDTIMEO, 100)
dealer.connect(sys.argv[1])
request = [b"", (0).to_bytes(8, "big")]
print("ready", flush=True)
stalled = False
while os.getppid() == parent:
    try:
        dealer.send_multipart(request)
    except zmq.Again:
        if not stalled:
            print("stalled", flush=True)
            stalled = True
"""


def replay_flood(tmp: Path, held_blocks: int, stores: int) -> dict[str, Any]:
    """The store latency quiet, during a replay flood and after it, in one sidecar."""
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    args = ["--block-tokens", str(BLOCK), "--chunk-tokens", "16", "--layout", "importance"]
    args += ["--kv-events", endpoint]
    sidecar = Sidecar(tmp, args=[*args, "--kv-events-replay", replay]).start()
    try:
        rng = np.random.default_rng(4)
        kv = rng.standard_normal(MODEL.kv_shape(BLOCK)).astype(MODEL.np_dtype)
        with KVClient(sidecar.address) as client:
            _latencies(client, rng, kv, held_blocks)  # what a snapshot describes
            quiet = _latencies(client, rng, kv, stores)
            flooder = _start_flooder(replay)
            try:
                during = _latencies(client, rng, kv, stores)
            finally:
                flooder.kill()
                flooder.wait(10)
            after = _latencies(client, rng, kv, stores)
        refused = _metric(sidecar, "kvsieve_kv_events_replays_refused_total")
    finally:
        sidecar.kill()
    p50 = {name: 1000 * statistics.median(lat) for name, lat in (("q", quiet), ("d", during), ("a", after))}
    return {
        "store_p50_ms_quiet": round(p50["q"], 2),
        "store_p50_ms_replay_flood": round(p50["d"], 2),
        "store_p50_ms_after_replay_flood": round(p50["a"], 2),
        "store_p50_replay_flood_vs_quiet": round(p50["d"] / p50["q"], 3),
        "store_p50_after_replay_flood_vs_quiet": round(p50["a"] / p50["q"], 3),
        "replay_flood_refused": int(refused),
    }


def _latencies(client: KVClient, rng: np.random.Generator, kv: Any, count: int) -> list[float]:
    """Seconds of each of `count` Stores of a new one-block prompt."""
    seconds = []
    for _ in range(count):
        tokens = rng.integers(0, 50_000, BLOCK).tolist()
        start = time.perf_counter()
        client.store(tokens, kv, model=MODEL)
        seconds.append(time.perf_counter() - start)
    return seconds


def _start_flooder(replay: str, timeout_s: float = 60) -> subprocess.Popen[str]:
    """The flooding process, once its socket stopped taking requests."""
    command = [sys.executable, "-c", FLOODER, replay, str(os.getpid())]
    flooder = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert flooder.stdout is not None
    deadline = time.monotonic() + timeout_s
    for expected in ("ready", "stalled"):
        line = flooder.stdout.readline().strip()
        if line != expected or time.monotonic() > deadline:
            flooder.kill()
            raise RuntimeError(f"the replay flooder said {line!r}, not {expected!r}")
    return flooder


def _metric(sidecar: Sidecar, name: str) -> float:
    page = urllib.request.urlopen(f"http://127.0.0.1:{sidecar.metrics_port}/metrics", timeout=10)
    for line in page.read().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise RuntimeError(f"{name} is not among the sidecar's metrics")
