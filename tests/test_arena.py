"""The memory tier's host arena (kvstore/tiers/arena.py): ranges carved from segments, reused only
once no view of them is left, so an evicted record a load still reads is never overwritten."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
from test_tiers_contract import make_block

from kvstore.tiers.arena import ALIGN, HostArena
from kvstore.tiers.memory import MemoryTier


def _bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_a_record_comes_back_whole_and_read_only() -> None:
    arena = HostArena(1 << 20, pin=False, segment_bytes=1 << 16)
    data = _bytes(10_000, 1)
    held = arena.copy_in(data)
    assert held is not None and held.tobytes() == data and not held.flags.writeable
    assert arena.is_arena_memory(held) and not arena.is_arena_memory(np.frombuffer(data, np.uint8))
    assert arena.usage().used_bytes == 3 * ALIGN  # 10,000 bytes rounded up to whole pages


def test_a_range_is_reused_only_after_every_view_is_gone() -> None:
    arena = HostArena(1 << 16, pin=False, segment_bytes=1 << 16)  # one segment, room for 16 pages
    first = arena.copy_in(_bytes(8 * ALIGN, 2))
    assert first is not None
    view = memoryview(first)[100:200]  # what a load keeps of a record the tier has evicted
    expected = bytes(view)
    del first
    gc.collect()
    assert arena.usage().used_bytes == 8 * ALIGN  # still held through the view
    second = arena.copy_in(_bytes(8 * ALIGN, 3))
    third = arena.copy_in(_bytes(ALIGN, 4))
    assert second is not None and third is None  # full: the viewed range is not handed out again
    assert bytes(view) == expected
    del view
    gc.collect()
    assert arena.usage().used_bytes == 8 * ALIGN
    assert arena.copy_in(_bytes(8 * ALIGN, 5)) is not None  # the range came back, whole


def test_freed_neighbours_join_into_one_range() -> None:
    arena = HostArena(1 << 16, pin=False, segment_bytes=1 << 16)
    parts = [arena.copy_in(_bytes(4 * ALIGN, i)) for i in range(4)]
    assert all(p is not None for p in parts)
    del parts
    gc.collect()
    assert arena.copy_in(_bytes(16 * ALIGN, 9)) is not None  # only fits if the four joined
    assert arena.usage().segments == 1


def test_a_record_larger_than_a_segment_gets_its_own_and_capacity_holds() -> None:
    arena = HostArena(3 << 16, pin=False, segment_bytes=1 << 16)
    big = arena.copy_in(_bytes(2 << 16, 6))
    assert big is not None and arena.usage().segments == 1 and arena.usage().segment_bytes == 2 << 16
    small = arena.copy_in(_bytes(1 << 16, 7))
    assert small is not None and arena.usage().segments == 2
    assert arena.copy_in(_bytes(ALIGN, 8)) is None  # a third segment would pass capacity_bytes


def test_bad_sizes_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="capacity_bytes must be >= 0"):
        HostArena(-1, pin=False)
    with pytest.raises(ValueError, match="segment_bytes must be at least 4096"):
        HostArena(1 << 20, pin=False, segment_bytes=100)


def test_threads_storing_and_dropping_never_share_a_range() -> None:
    arena = HostArena(1 << 22, pin=False, segment_bytes=1 << 18)
    errors: list[str] = []

    def work(seed: int) -> None:
        for i in range(200):
            data = _bytes(ALIGN * (1 + (seed + i) % 5), seed * 1000 + i)
            held = arena.copy_in(data)
            if held is not None and held.tobytes() != data:
                errors.append(f"thread {seed} record {i} came back changed")

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    assert errors == [] and arena.usage().used_bytes == 0


def test_the_memory_tier_keeps_evicted_records_readable_through_the_arena() -> None:
    arena = HostArena(1 << 20, pin=False, segment_bytes=1 << 16)
    tier = MemoryTier(1 << 20, arena=arena)
    meta, chunks = make_block(1)
    tier.put_block(meta, chunks)
    got = tier.get_chunks(meta, [0])[0]
    assert got is not None and arena.is_arena_memory(np.frombuffer(got, np.uint8))
    tier.delete_block(meta.key)
    for key_byte in range(2, 12):  # new blocks take the free ranges
        other, other_chunks = make_block(key_byte)
        tier.put_block(other, other_chunks)
    assert bytes(got) == chunks[0]  # the load's view still holds the evicted bytes
    assert tier.usage().used_bytes == sum(len(c) for c in other_chunks) * 10


def test_take_without_growing_uses_only_segments_already_there_and_added_ones() -> None:
    arena = HostArena(1 << 18, pin=False, segment_bytes=1 << 16)
    assert arena.take(4096, grow=False) is None
    assert arena.add_segment(np.zeros(1 << 17, np.uint8))
    a = arena.take(1 << 16, grow=False)
    assert a is not None and a.flags.writeable and arena.usage().used_bytes == 1 << 16
    a[:] = 7
    assert not arena.add_segment(np.zeros(1 << 18, np.uint8))  # past the capacity: refused
    assert arena.usage().segments == 1
    del a
    assert arena.usage().used_bytes == 0
