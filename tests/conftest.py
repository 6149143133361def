"""Shared fixtures and helpers: small model shapes, stores on tmp_path, deterministic KV, the CLI
in a subprocess, servers in a thread, a corrupted chunk."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from bench.common.sidecar import Sidecar
from kvstore.config import StoreConfig
from kvstore.model import ModelSpec
from kvstore.store.tiered import TieredStore

if TYPE_CHECKING:
    from engine_adapter.runner.costs import CostModel

TINY = ModelSpec("test-tiny", num_layers=2, num_kv_heads=2, head_dim=4)
#: The default model's weights are random here: the GPU kit (../shared/device/on-device.sh) sets it,
#: since the real weights do not fit what a call to the GPU machine may carry. Right for code paths
#: and timing; what the model answers means nothing. Tests marked `real_weights` skip under it, and
#: tests that check a path and also compare answers compare them only without it.
RANDOM_WEIGHTS = os.environ.get("KVSIEVE_RANDOM_WEIGHTS") == "1"
REAL_WEIGHTS_REASON = (
    "asserts what the real model's weights answer; KVSIEVE_RANDOM_WEIGHTS=1: the default model's "
    "weights are random here (the GPU kit)"
)


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


def kvsieve(
    *args: str, timeout: float = 300, stdin: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`kvsieve ARGS` in a child of this Python (it inherits PYTHONPATH); `env` adds variables."""
    return subprocess.run(
        [sys.executable, "-m", "kvstore.cli.main", *args], capture_output=True, text=True, timeout=timeout,
        input=stdin, env=None if env is None else {**os.environ, **env},
    )  # fmt: skip


def corrupt_chunk(config: StoreConfig, block_key: bytes, chunk_index: int, offset: int | None = None) -> None:
    """Flip one byte (the middle one, or at `offset`) of a stored chunk in place, with LMDB itself
    (the store is closed)."""
    import lmdb

    from kvstore.format.block_meta import BlockMeta
    from kvstore.keys import chunk_key

    env = lmdb.open(str(config.lmdb_dir), max_dbs=4, map_size=1 << 34)  # the file may exceed the default
    db = env.open_db(b"chunks")
    with env.begin(write=True, db=db) as txn:
        version = BlockMeta.from_bytes(txn.get(block_key, db=env.open_db(b"blocks", txn=txn))).layout_version
        key = chunk_key(block_key, version, chunk_index)
        data = bytearray(txn.get(key))
        data[len(data) // 2 if offset is None else offset] ^= 0x01
        txn.put(key, bytes(data))
    env.close()


class ServerInThread:
    """A gRPC server started by `start` (a coroutine returning a running server with `address`
    and `stop(grace)`, e.g. kvstore.server.app.start), served by an event loop in a thread."""

    def __init__(self, start: Coroutine[Any, Any, Any]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.running = asyncio.run_coroutine_threadsafe(start, self.loop).result(30)
        self.address: str = self.running.address

    def stop(self) -> None:
        """Stop the server (1 s grace), then the loop; the thread must have ended."""
        asyncio.run_coroutine_threadsafe(self.running.stop(1), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        assert not self.thread.is_alive()
        self.loop.close()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free loopback port, for the whole session.

    Skipped when redis-server is not installed, unless KVSIEVE_REQUIRE_REDIS=1
    (set by .ci/run), where a missing server fails the run instead.
    """
    require_redis_server()
    from bench.common.redisd import RedisNode

    node = RedisNode(tmp_path_factory.mktemp("redis")).start()
    yield node.url
    node.stop()


#: A test that takes one of these needs redis-server: it is marked `redis` (pytest_collection_modifyitems).
REDIS_FIXTURES = frozenset({"redis_url", "redis_cluster", "private_cluster"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `redis` every test that takes a Redis fixture, so that `-m redis` finds them all; skip
    the `real_weights` tests where the weights are random (`RANDOM_WEIGHTS`), before their fixtures
    load anything."""
    for item in items:
        if REDIS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.redis)
        if RANDOM_WEIGHTS and item.get_closest_marker("real_weights") is not None:
            item.add_marker(pytest.mark.skip(reason=REAL_WEIGHTS_REASON))


#: Extras of pyproject.toml that some tests need, with the modules that tell they are installed.
EXTRAS = {"events": ("zmq", "msgspec"), "bench": ("matplotlib",), "uring": ("liburing",)}


def extra_installed(extra: str) -> bool:
    """Whether every module of `extra` (EXTRAS) can be imported."""
    return all(importlib.util.find_spec(module) is not None for module in EXTRAS[extra])


def require_extra(extra: str) -> None:
    """Skip without `extra`, or fail under KVSIEVE_REQUIRE_<EXTRA>=1 (.ci/run sets them). At a
    module's top it skips the module."""
    if not extra_installed(extra):
        variable = f"KVSIEVE_REQUIRE_{extra.upper()}"
        missing = (
            f"the `{extra}` extra is not installed ({', '.join(EXTRAS[extra])}: pip install -e '.[{extra}]')"
        )
        if os.environ.get(variable) == "1":
            pytest.fail(f"{variable}=1 but {missing}", pytrace=False)
        pytest.skip(missing, allow_module_level=True)


def require_sglang() -> Path:
    """The SGLang environment's interpreter (bash bench/sglang/setup_sglang.sh); skip without it, or fail
    under KVSIEVE_REQUIRE_SGLANG=1 (.ci/run)."""
    import os

    from bench.sglang.environment import sglang_python

    python = sglang_python()
    if not python.exists():
        if os.environ.get("KVSIEVE_REQUIRE_SGLANG") == "1":
            pytest.fail(f"KVSIEVE_REQUIRE_SGLANG=1 but there is no SGLang environment at {python}")
        pytest.skip(f"no SGLang environment at {python} (bash bench/sglang/setup_sglang.sh)")
    return python


def require_redis_server() -> None:
    """Skip when redis-server is missing, or fail under KVSIEVE_REQUIRE_REDIS=1 (.ci/run)."""
    import os

    from bench.common.redisd import server_binary

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
    from bench.common.redisd import LocalCluster

    cluster = LocalCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def private_cluster(tmp_path: Path) -> Iterator[Any]:
    """A 3-node cluster of this test's own, which it may kill and restart."""
    require_redis_server()
    from bench.common.redisd import LocalCluster

    cluster = LocalCluster(tmp_path / "cluster").start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    """A `kvsieve serve` subprocess on a free loopback port, shared by a test module."""
    server = Sidecar(tmp_path_factory.mktemp("sidecar")).start()
    yield server
    server.kill()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """Mounts real tmpfs file systems of a given size; skips where mounting is not allowed."""
    mounted: list[Path] = []

    def mount(size_bytes: int) -> Path:
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(point)]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except FileNotFoundError:
            pytest.skip("no mount command on this machine")
        if result.returncode:
            pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {result.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], capture_output=True, timeout=30)


def measured_costs(disk_gb_s: float, tokens_s: float) -> CostModel:
    """A cost model (engine_adapter/runner/costs.py) that measured a disk of `disk_gb_s` GB/s and a
    prefill of `tokens_s` tokens/s: rates another device, or another model, showed."""
    from engine_adapter.runner.costs import CostModel

    costs = CostModel()
    costs.observe_read("disk", int(disk_gb_s * 1e9), 1.0)
    for n in (1024, 2048, 4096):
        costs.observe_prefill(n, 0, n / tokens_s)
    return costs
