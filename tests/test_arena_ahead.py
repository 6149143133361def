"""Cold reads land in memory that is ready (issue 47, item 1), proved on the CPU.

`StoreConfig.host_arena=True` runs the GPU's memory layout here: the memory tier's records in a
`HostArena` (unpinned on the CPU, page-locked where CUDA is; the bookkeeping is the same). A started
store makes that arena's segments on its own low-priority thread (`SegmentsAhead`,
kvstore/tiers/jobs.py), so no load ever makes one; a block a cold load reads lands in the arena
and the memory tier keeps those very bytes; and promoting it costs the load the same few index
calls per block whatever its layers or chunks (counted, never timed).
"""

from __future__ import annotations

import gc
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvstore.tiers.memory as memory_module
from kvstore.config import StoreConfig
from kvstore.index.eviction import ScorePolicy
from kvstore.index.store_index import StoreIndex
from kvstore.load.fetch import RecordFetcher
from kvstore.model import ModelSpec
from kvstore.store.tiered import TieredStore
from kvstore.tiers.arena import HostArena
from kvstore.tiers.jobs import JobThread, SegmentsAhead
from tests.conftest import make_kv, make_tokens

#: 4 KiB of KV a token: a 256-token block's pack is ~1 MiB, what the disk tier reads into the arena.
WIDE = ModelSpec("test-arena-wide", num_layers=4, num_kv_heads=4, head_dim=64)
SEGMENT = 4 << 20
AHEAD_THREAD = "kvsieve-arena-ahead"


def _config(tmp_path: Path, ahead: int, layout: str = "layered") -> StoreConfig:
    return StoreConfig(
        data_dir=tmp_path / "data", memory_bytes=64 << 20, host_arena=True, warm_read_ahead_bytes=ahead,
        layout=layout,
    )  # fmt: skip


@pytest.fixture
def small_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Segments of 4 MiB, so that a 16 MiB load needs several made while it runs."""
    monkeypatch.setattr(memory_module, "ARENA_SEGMENT_BYTES", SEGMENT)


def _stored(config: StoreConfig, model: ModelSpec, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    tokens, kv = make_tokens(num_tokens, 3), make_kv(model, num_tokens, 3)
    with TieredStore(config) as store:
        store.store(tokens, kv, model=model)
        store.flush()
    return tokens, kv


def _ordered(store: TieredStore, tokens: np.ndarray, model: ModelSpec) -> np.ndarray:
    with store.load(tokens, model=model) as stream:
        positions, kv = stream.gather(model)
    return np.asarray(kv[:, :, :, np.argsort(positions)])


def test_a_started_store_makes_no_segment_on_the_loading_thread(tmp_path: Path, small_segments: None) -> None:
    """The first segment is made at the store's start (one segment is what is kept ahead); a 16 MiB
    cold load needs four more: the ahead thread makes every one it makes, the loading thread none
    (a read that finds no room meanwhile lands in fresh memory)."""
    config = _config(tmp_path, ahead=SEGMENT)
    tokens, kv = _stored(config, WIDE, 4096)
    with TieredStore(config) as store:
        assert store.arena_ahead is not None and store.memory.arena is store.arena_ahead.arena
        arena = store.memory.arena
        assert store.arena_ahead.wait()
        started = arena.segment_threads()
        assert started == [threading.current_thread().name]  # the start's own, before any load
        loaded = _ordered(store, tokens, WIDE)
        assert store.arena_ahead.wait()  # the load's takes asked for more meanwhile
        made_by = arena.segment_threads()
        assert store.stats().counters.get("chunk_hits.lmdb", 0) == 16  # every block from disk
    np.testing.assert_array_equal(loaded, kv)
    during = made_by[len(started) :]
    assert during and set(during) == {AHEAD_THREAD}  # more were needed: none made by the loading thread
    assert threading.current_thread().name != AHEAD_THREAD


def test_a_cold_block_lands_in_the_arena_and_memory_keeps_those_bytes(
    tmp_path: Path, small_segments: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With room made ahead, promotion copies nothing: the memory tier's record is the read itself."""
    config = _config(tmp_path, ahead=24 << 20)
    tokens, kv = _stored(config, WIDE, 4096)
    copies: list[int] = []
    copy_in = HostArena.copy_in
    monkeypatch.setattr(HostArena, "copy_in", lambda self, data: copies.append(1) or copy_in(self, data))
    with TieredStore(config) as store:
        assert store.arena_ahead is not None and store.arena_ahead.wait()
        arena = store.memory.arena
        assert arena is not None
        used_before = arena.usage().used_bytes
        loaded = _ordered(store, tokens, WIDE)
        assert copies == []  # read into the arena, kept there: no copy on promotion
        metas = [node.payload for node in store.tree.nodes()]
        held = [h for m in metas if (h := store.memory.get_chunks(m, [m.pack_index])[0]) is not None]
        assert len(held) == 16 and all(arena.is_arena_memory(np.frombuffer(h, np.uint8)) for h in held)
        assert arena.usage().used_bytes - used_before >= sum(len(h) for h in held)
        again = _ordered(store, tokens, WIDE)  # from memory now
        assert store.stats().counters.get("chunk_hits.memory", 0) == 16
    np.testing.assert_array_equal(loaded, kv)
    np.testing.assert_array_equal(again, kv)


def test_without_room_made_ahead_a_read_goes_to_fresh_memory_and_is_kept(
    tmp_path: Path, small_segments: None
) -> None:
    """The arena's room is all taken and nothing may grow it in line: the load still completes,
    bit-exact, the memory tier keeping the bytes read outside the arena (unpinned, never pinned
    one by one), and no segment is made on this thread."""
    config = _config(tmp_path, ahead=SEGMENT)
    tokens, kv = _stored(config, WIDE, 2048)
    with TieredStore(config) as store:
        assert store.arena_ahead is not None and store.arena_ahead.wait()
        store.arena_ahead.close()  # no more segments: every take past the first one misses
        made = store.memory.arena.segment_threads() if store.memory.arena is not None else []
        loaded = _ordered(store, tokens, WIDE)
        assert store.memory.arena is not None
        assert store.memory.arena.segment_threads() == made and len(made) == 1
        assert store.stats().tiers["memory"].num_chunks == 8  # every block promoted all the same
    np.testing.assert_array_equal(loaded, kv)


def test_a_cold_full_load_reads_its_packs_on_a_reader_thread(
    tmp_path: Path, small_segments: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The views a device copies from: each pack read (and its records' checksum verified) on a
    thread of its own while the loading thread checks the headers and promotes the block before;
    the thread ends with the load, also when the caller stops early."""
    from kvstore.load.stream import LocalLoadStream
    from kvstore.tiers.disk.pread import MapReader

    config = _config(tmp_path, ahead=24 << 20)
    tokens, kv = _stored(config, WIDE, 2048)
    readers: list[str] = []
    read = MapReader.read
    monkeypatch.setattr(
        MapReader,
        "read",
        lambda self, items: readers.append(threading.current_thread().name) or read(self, items),
    )
    with TieredStore(config) as store:
        with store.load(tokens, model=WIDE) as stream:
            assert isinstance(stream, LocalLoadStream)
            views = stream.pack_views()
            assert views is not None
            listed = list(views)
        assert len(listed) == 8 and len(readers) == 8
        assert threading.current_thread().name not in readers  # every pack read off this thread
        with store.load(tokens, model=WIDE) as stream:  # from memory now: no reader thread at all
            assert isinstance(stream, LocalLoadStream)
            again = stream.pack_views()
            assert again is not None and len(list(again)) == 8
        assert len(readers) == 8
    with TieredStore(config) as store, store.load(tokens, model=WIDE) as stream:
        assert isinstance(stream, LocalLoadStream)
        views = stream.pack_views()
        assert views is not None
        next(views)  # the caller stops after one block: the reader thread still ends
        views.close()  # type: ignore[attr-defined]
    assert not any(t.name == "kvsieve-layers-ahead" for t in threading.enumerate())
    for view in listed:
        layer0 = np.ndarray((view.num_chunks, *view.chunk_shape), view.dtype, view.data, view.first)
        start = view.block_index * 256
        np.testing.assert_array_equal(
            layer0[:, 0].transpose(1, 0, 2, 3).reshape(4, 256, 64), kv[0, 0, :, start : start + 256]
        )


# -- index work per promoted block: the same whatever the layers and chunks ------------------------


def _counting(monkeypatch: pytest.MonkeyPatch, calls: Counter[str], owner: Any, name: str) -> None:
    original: Callable[..., Any] = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)


INDEX_CALLS = ("promote_many", "touch_memory", "_make_room_locked", "_memory_changed_locked")


def _index_calls_per_block(
    tmp_path: Path, model: ModelSpec, layout: str, monkeypatch: pytest.MonkeyPatch
) -> dict[str, float]:
    """Calls into the index, its policy and the fetcher's header cache per block of a cold full load."""
    config = _config(tmp_path / model.name / layout, ahead=SEGMENT, layout=layout)
    tokens, kv = _stored(config, model, 1024)
    calls: Counter[str] = Counter()
    with monkeypatch.context() as patch:
        for name in INDEX_CALLS:
            _counting(patch, calls, StoreIndex, name)
        _counting(patch, calls, ScorePolicy, "touch")
        _counting(patch, calls, RecordFetcher, "_keep")
        _counting(patch, calls, RecordFetcher, "keep_pack")
        with TieredStore(config) as store:
            loaded = _ordered(store, tokens, model)
            blocks = store.tree.num_blocks
    np.testing.assert_array_equal(loaded, kv)
    return {name: calls[name] / blocks for name in (*INDEX_CALLS, "touch", "_keep", "keep_pack")}


@pytest.mark.parametrize("layers", [2, 8, 32])
def test_promoting_a_packed_block_costs_one_index_step_whatever_its_layers(
    tmp_path: Path, layers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = ModelSpec(f"test-layers-{layers}", num_layers=layers, num_kv_heads=2, head_dim=16)
    per_block = _index_calls_per_block(tmp_path, model, "layered", monkeypatch)
    assert per_block == {
        "promote_many": 1, "touch_memory": 0, "_make_room_locked": 1, "_memory_changed_locked": 1,
        "touch": 1,  # the policy learns of the block's one record, its pack
        "_keep": 0, "keep_pack": 1,  # the headers kept as one list, none one by one
    }  # fmt: skip


def test_promoting_a_block_of_chunks_costs_one_index_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The importance layout: 16 chunk records a block, promoted in one call (one lock, room made
    once, the block's news once); the policy still learns of each record (it evicts chunks)."""
    model = ModelSpec("test-chunks", num_layers=4, num_kv_heads=2, head_dim=16)
    per_block = _index_calls_per_block(tmp_path, model, "importance", monkeypatch)
    assert per_block["promote_many"] == 1 and per_block["_make_room_locked"] == 1
    assert per_block["_memory_changed_locked"] == 1 and per_block["touch_memory"] == 1
    assert per_block["touch"] == 16 and per_block["_keep"] == 0


# -- the mechanism itself ------------------------------------------------------------------------


def test_segments_ahead_stop_at_the_capacity_and_a_take_never_grows() -> None:
    arena = HostArena(3 << 16, pin=False, segment_bytes=1 << 16)
    ahead = SegmentsAhead(arena, "kvsieve-test-ahead", ahead_bytes=8 << 16)  # more than the capacity
    try:
        assert arena.take(4096) is None  # nothing made yet, and a take may not make one ...
        assert ahead.wait()  # ... it asked the thread, which makes segments up to the capacity
        assert arena.usage().segment_bytes == 3 << 16
        assert arena.segment_threads() == ["kvsieve-test-ahead"] * 3
        taken = [arena.take(1 << 16) for _ in range(4)]
        assert sum(t is not None for t in taken) == 3  # full: the fourth misses, no fourth segment
        assert arena.make_segment() is False and arena.usage().segments == 3
        del taken
        gc.collect()
        assert arena.take(1 << 16) is not None  # freed ranges come back
    finally:
        ahead.close()


def test_keep_hands_back_a_read_only_view_of_the_arena_and_copies_anything_else() -> None:
    arena = HostArena(1 << 20, pin=False, segment_bytes=1 << 20)
    assert arena.make_segment()
    out = arena.take(3 * 4096)
    assert out is not None
    out[:] = 7
    out.flags.writeable = False
    part = memoryview(out)[4096:8192]  # what a read hands on: a view of part of its range
    kept = arena.keep(part)
    assert kept is not None and np.shares_memory(kept, out) and not kept.flags.writeable
    writable = arena.take(4096)
    assert writable is not None
    copied = arena.keep(writable)  # writable: someone may still change it, so it is copied
    outside = arena.keep(b"x" * 100)
    assert copied is not None and not np.shares_memory(copied, writable)
    assert outside is not None and outside.tobytes() == b"x" * 100 and arena.is_arena_memory(outside)


def test_a_job_thread_at_low_priority_runs_its_jobs_in_order() -> None:
    jobs = JobThread("kvsieve-test-low", low_priority=True)
    ran: list[int] = []
    done = threading.Event()
    for i in range(3):
        jobs.submit(lambda i=i: ran.append(i))  # type: ignore[misc]
    jobs.submit(done.set)
    assert done.wait(10)
    jobs.close()
    assert ran == [0, 1, 2]
    assert not any(t.name == "kvsieve-test-low" for t in threading.enumerate())
