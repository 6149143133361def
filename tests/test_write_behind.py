"""Stores acknowledged from memory, written to disk behind (issue #40, items 1 and 2).

Real LMDB under tmp_path, a real tmpfs filled for real, and a real `kvsieve serve` over a
socket for the status a refused Store gets. A long `commit_ms` holds blocks in the backlog
for as long as a test needs, because the writer waits that long for a group to fill.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import make_kv, make_tokens
from hostile import wait_until

from bench.common.sidecar import Sidecar
from kvstore.client.kvclient import KVClient
from kvstore.config import StoreConfig
from kvstore.errors import InvalidInputError, LimitExceededError, StoreFullError
from kvstore.model import ModelSpec
from kvstore.offline.fsck import fsck
from kvstore.rpc.status import status_for
from kvstore.store.tiered import TieredStore
from kvstore.tiers.behind import BehindQueue

WIDE = ModelSpec("behind-test", num_layers=4, num_kv_heads=4, head_dim=64)  # 128 KiB a 32-token block
N = 128  # tokens a prompt: 4 blocks
Array = np.ndarray[Any, Any]


def config(data_dir: Path, **kw: object) -> StoreConfig:
    fields: dict[str, object] = {"block_tokens": 32, "chunk_tokens": 8, "memory_bytes": 64 << 20, **kw}
    return StoreConfig(data_dir=data_dir, **fields)


def prompt(i: int) -> tuple[Array, Array]:
    return make_tokens(N, seed=i), make_kv(WIDE, N, seed=i)


def exact(store: TieredStore, i: int) -> bool:
    """Prompt `i` loads whole and bit-exact (False: a miss; anything else fails the test)."""
    tokens, kv = prompt(i)
    covered, _positions, loaded = store.load_arrays(tokens, model=WIDE)
    assert covered in (0, N) or covered % 32 == 0
    assert loaded.tobytes() == kv[:, :, :, :covered].tobytes()
    return covered == N


def test_a_store_is_served_from_memory_before_its_commit_and_close_drains(tmp_path: Path) -> None:
    cfg = config(tmp_path / "d", commit_ms=60_000)  # nothing is committed until close
    with TieredStore(cfg) as store:
        for i in range(3):
            store.store(*prompt(i), model=WIDE)
        stats = store.stats()
        assert stats.get("disk_backlog_blocks") == 12 and stats.get("disk_commits") == 0
        assert store.durable[0].usage().num_blocks == 0  # the disk has none of them yet
        assert all(exact(store, i) for i in range(3))  # memory serves every one
    with TieredStore(cfg) as store:  # close committed the backlog
        assert store.orphans == 0 and all(exact(store, i) for i in range(3))
    assert fsck(tmp_path / "d").clean


def test_sync_stores_write_before_the_acknowledgement(tmp_path: Path) -> None:
    with TieredStore(config(tmp_path / "d", sync_stores=True)) as store:
        store.store(*prompt(0), model=WIDE)
        assert store.durable[0].usage().num_blocks == 4
        assert "disk_backlog_blocks" not in store.stats().counters


def test_a_full_backlog_refuses_a_store_naming_the_setting_and_keeps_nothing_of_it(tmp_path: Path) -> None:
    one = 4 * (128 << 10)  # about one prompt's bytes
    cfg = config(tmp_path / "d", commit_ms=60_000, disk_backlog_bytes=one + 4096, backlog_wait_s=0)
    with TieredStore(cfg) as store:
        store.store(*prompt(0), model=WIDE)
        with pytest.raises(LimitExceededError, match="disk_backlog_bytes") as info:
            store.store(*prompt(1), model=WIDE)
        assert status_for(info.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert store.lookup(prompt(1)[0], model=WIDE).num_tokens == 0
        assert store.stats().get("disk_backlog_refusals") == 1
        assert store.flush(30)  # the writer commits at once when asked
        store.store(*prompt(1), model=WIDE)
        assert exact(store, 0) and exact(store, 1)


def test_a_store_over_the_bound_waits_for_the_commit(tmp_path: Path) -> None:
    one = 4 * (128 << 10)
    cfg = config(tmp_path / "d", commit_ms=60_000, disk_backlog_bytes=one + 4096, backlog_wait_s=60)
    with TieredStore(cfg) as store:
        store.store(*prompt(0), model=WIDE)
        store.store(*prompt(1), model=WIDE)  # waits: the writer hurries
        assert store.stats().get("disk_backlog_waits") == 1
        assert store.durable[0].usage().num_blocks >= 4  # prompt 0 reached the disk first
        assert exact(store, 0) and exact(store, 1)


def test_blocks_memory_cannot_hold_go_to_disk_after_the_backlog(tmp_path: Path) -> None:
    # Memory for about two prompts: the backlog pins them, so the third is written through.
    cfg = config(tmp_path / "d", commit_ms=60_000, memory_bytes=9 * (128 << 10) + 4096)
    with TieredStore(cfg) as store:
        for i in range(4):
            store.store(*prompt(i), model=WIDE)
        assert all(exact(store, i) for i in range(4))
        assert store.durable[0].usage().num_blocks >= 8  # the backlog went first, then the rest
    with TieredStore(cfg) as store:
        assert store.orphans == 0 and all(exact(store, i) for i in range(4))


def test_pending_blocks_are_never_evicted_from_memory(tmp_path: Path) -> None:
    cfg = config(tmp_path / "d", memory_bytes=6 * (128 << 10) + 4096, sync_stores=True)
    with TieredStore(cfg) as store:  # an older prompt on disk, to be promoted into memory
        store.store(*prompt(9), model=WIDE)
    with TieredStore(config(tmp_path / "d", memory_bytes=cfg.memory_bytes, commit_ms=60_000)) as store:
        store.store(*prompt(0), model=WIDE)  # 4 blocks pending in memory
        assert exact(store, 9)  # promotion wants room: it may not take the pending blocks
        assert store.stats().get("disk_backlog_blocks") == 4 and exact(store, 0)


def test_a_budget_held_by_pins_refuses_the_store_before_acknowledging_it(tmp_path: Path) -> None:
    with TieredStore(config(tmp_path / "d", disk_bytes=5 * (128 << 10))) as store:
        store.store(*prompt(0), model=WIDE)
        store.pin(prompt(0)[0], model=WIDE)
        with pytest.raises(StoreFullError, match="held by pinned blocks"):
            store.store(*prompt(1), model=WIDE)
        assert store.lookup(prompt(1)[0], model=WIDE).num_tokens == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("commit_blocks", 0), ("commit_ms", -1), ("disk_backlog_bytes", 0), ("backlog_wait_s", "x")],
)
def test_bad_write_behind_settings_are_named(tmp_path: Path, field: str, value: object) -> None:
    with pytest.raises(InvalidInputError, match=field):
        config(tmp_path, **{field: value})


def test_a_disk_that_fills_mid_commit_leaves_memory_serving_and_the_backlog_reported(
    tmpfs: Callable[[int], Path],
) -> None:
    data_dir = tmpfs(3 << 20) / "data"
    cfg = config(data_dir, disk_backlog_bytes=4 << 20, backlog_wait_s=0.5)
    stored: list[int] = []
    with TieredStore(cfg) as store:
        with pytest.raises(LimitExceededError, match="disk_backlog_bytes"):
            for i in range(64):  # 32 MiB: the disk fills, then the backlog, then stores are refused
                store.store(*prompt(i), model=WIDE)
                stored.append(i)
        stats = store.stats()
        assert stats.get("disk_commit_failures") >= 1 and stats.get("disk_backlog_blocks") > 0
        assert stats.get("disk_backlog_bytes") > 0
        assert all(exact(store, i) for i in stored)  # memory serves the backlog, bit-exact
    with TieredStore(cfg) as store:  # what the disk took is whole; the rest is a miss
        assert store.orphans == 0
        held = [exact(store, i) for i in stored]
        assert any(held) and not all(held)
    assert fsck(data_dir).clean


@pytest.fixture
def backlogged_sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    server = Sidecar(
        tmp_path / "data",
        ["--commit-ms", "60000", "--disk-backlog-bytes", str(600 << 10), "--backlog-wait-s", "0"],
    ).start()
    yield server
    server.kill()


def test_over_grpc_a_full_backlog_is_resource_exhausted_naming_the_setting(
    backlogged_sidecar: Sidecar,
) -> None:
    with KVClient(backlogged_sidecar.address, use_shm=False) as client:
        client.store(*prompt(0), model=WIDE)
        with pytest.raises(StoreFullError, match="disk_backlog_bytes"):  # RESOURCE_EXHAUSTED
            client.store(*prompt(1), model=WIDE)
        counters = client.stats().counters
        assert counters["disk_backlog_refusals"] == 1 and counters["disk_backlog_blocks"] == 4
        assert client.lookup(prompt(0)[0], model=WIDE).num_tokens == N


def test_sigterm_commits_the_backlog(tmp_path: Path) -> None:
    server = Sidecar(tmp_path / "data", ["--commit-ms", "60000"]).start()
    try:
        with KVClient(server.address, use_shm=False) as client:
            for i in range(3):
                client.store(*prompt(i), model=WIDE)
            assert client.stats().counters["disk_backlog_blocks"] == 12
        code, _ = server.terminate()
        assert code == 0
    finally:
        server.kill()
    with TieredStore(config(tmp_path / "data")) as store:
        assert all(exact(store, i) for i in range(3))


def test_a_batch_takes_at_most_batch_bytes_in_submission_order() -> None:
    """The disk's group commits are a quarter of the backlog at most, so that Stores can queue
    the next ones while one is written; a block larger than that goes alone, order is kept."""
    gate, batches = threading.Event(), []

    def write(items: list[str]) -> None:
        assert gate.wait(10)
        batches.append(items)

    queue = BehindQueue(write, 1 << 20, batch_items=64, batch_bytes=100)
    queue.submit("first", 10)  # taken at once: the worker waits on the gate with it
    assert wait_until(lambda: not queue.peek(64))
    for item, size in (("a", 40), ("b", 40), ("c", 40), ("d", 250), ("e", 10)):
        queue.submit(item, size)
    assert queue.peek(2) == ["a", "b"]
    gate.set()
    assert queue.flush(10)
    queue.close(None)
    assert batches == [["first"], ["a", "b"], ["c"], ["d"], ["e"]]
