"""Shared fixtures: small model shapes, stores on tmp_path, deterministic KV."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.config import StoreConfig
from kvstore.model import ModelSpec
from kvstore.store import TieredStore

TINY = ModelSpec("test-tiny", num_layers=2, num_kv_heads=2, head_dim=4)


def make_kv(model: ModelSpec, num_tokens: int, seed: int = 0) -> np.ndarray[Any, Any]:
    """Deterministic random KV of `model`'s shape and dtype."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal(model.kv_shape(num_tokens)).astype(model.np_dtype)


def make_tokens(num_tokens: int, seed: int = 0) -> np.ndarray[Any, Any]:
    """Deterministic random token ids."""
    return np.random.default_rng(seed + 1000).integers(0, 50_000, num_tokens)


@pytest.fixture
def tiny() -> ModelSpec:
    return TINY


@pytest.fixture
def small_config(tmp_path: Path) -> StoreConfig:
    """Blocks of 32 tokens in chunks of 8, on an LMDB under tmp_path."""
    return StoreConfig(data_dir=tmp_path / "data", block_tokens=32, chunk_tokens=8, memory_bytes=64 << 20)


@pytest.fixture
def store(small_config: StoreConfig) -> Iterator[TieredStore]:
    with TieredStore(small_config) as s:
        yield s


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free loopback port, for the whole session.

    Skipped when redis-server is not installed, unless KVSIEVE_REQUIRE_REDIS=1
    (set by .ci/run), where a missing server fails the run instead.
    """
    import os
    import shutil
    import subprocess
    import time

    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        if os.environ.get("KVSIEVE_REQUIRE_REDIS") == "1":
            pytest.fail("redis-server is required (KVSIEVE_REQUIRE_REDIS=1) but not on PATH")
        pytest.skip("redis-server not installed")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    import redis

    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("redis-server did not start")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


def require_redis_server() -> None:
    """Skip when redis-server is missing, or fail under KVSIEVE_REQUIRE_REDIS=1 (.ci/run)."""
    import os

    from bench.redisd import server_binary

    if server_binary() is None:
        if os.environ.get("KVSIEVE_REQUIRE_REDIS") == "1":
            pytest.fail("redis-server is required (KVSIEVE_REQUIRE_REDIS=1) but not on PATH")
        pytest.skip("redis-server not installed")


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real 3-node Redis Cluster on free loopback ports, for the whole session.

    Tests share it: give each store its own `remote_prefix`. Tests that kill nodes
    use `private_cluster` instead. Skipped/required like `redis_url`.
    """
    require_redis_server()
    from bench.redisd import LocalCluster

    cluster = LocalCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def private_cluster(tmp_path: Path) -> Iterator[Any]:
    """A 3-node cluster of this test's own, which it may kill and restart."""
    require_redis_server()
    from bench.redisd import LocalCluster

    cluster = LocalCluster(tmp_path / "cluster").start()
    yield cluster
    cluster.stop()
