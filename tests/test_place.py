"""Placing loaded chunks into one KV array (kvstore/load/assemble.py): by position and in stream
order, scattered and consecutive positions, dtype conversion, the two-thread path, and
bad input that leaves the destination untouched."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import make_kv, make_tokens

from kvstore.config import StoreConfig
from kvstore.errors import InvalidInputError
from kvstore.load import assemble as place
from kvstore.load.assemble import place_chunks
from kvstore.load.stream import gather_chunks
from kvstore.model import ModelSpec
from kvstore.store.tiered import TieredStore
from kvstore.values import LoadedChunk

# 2 KiB per token, so 4,096 tokens (8 MiB) take the two-thread path.
WIDE = ModelSpec("test-place-wide", num_layers=4, num_kv_heads=2, head_dim=64)


def _chunks(kv: np.ndarray, order: np.ndarray, size: int, block_tokens: int) -> list[LoadedChunk]:
    """Chunks of `size` tokens taking positions `order` in turn, as a store delivers them."""
    out = []
    for i in range(0, len(order), size):
        positions = order[i : i + size].astype(np.int64)
        out.append(
            LoadedChunk(
                i // block_tokens, i % block_tokens // size, positions, kv[:, :, :, positions], "memory", 0
            )
        )
    return out


def test_consecutive_chunks_land_at_their_positions_in_any_order(tiny: ModelSpec) -> None:
    kv = make_kv(tiny, 64)
    chunks = _chunks(kv, np.arange(64), 8, 32)
    out = np.full_like(kv, 7)
    placed = place_chunks(chunks[::-1], out, at_positions=True)  # last chunk first
    assert np.array_equal(out, kv)
    assert placed.num_tokens == 64
    assert placed.positions.tolist() == np.concatenate([c.positions for c in chunks[::-1]]).tolist()


def test_scattered_positions_go_to_each_token_slot(tiny: ModelSpec) -> None:
    kv = make_kv(tiny, 64)
    order = np.random.default_rng(3).permutation(64)[:40]  # an importance order, 40 of 64 tokens
    out = np.zeros_like(kv)
    place_chunks(_chunks(kv, order, 8, 32), out, at_positions=True)
    assert np.array_equal(out[:, :, :, order], kv[:, :, :, order])
    untouched = np.setdiff1d(np.arange(64), order)
    assert not out[:, :, :, untouched].any()


def test_stream_order_fills_slots_from_zero_and_converts_dtype(tiny: ModelSpec) -> None:
    kv = make_kv(tiny, 48)
    order = np.random.default_rng(4).permutation(48)
    chunks = _chunks(kv, order, 8, 16)
    out = np.zeros(tiny.kv_shape(48), np.float32)
    placed = place_chunks(chunks, out, at_positions=False)
    assert out.dtype == np.float32
    assert np.array_equal(out, kv[:, :, :, order].astype(np.float32))
    assert placed.positions.tolist() == order.tolist()


def test_large_placements_copy_on_two_threads_with_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = make_kv(WIDE, 4096)
    chunks = _chunks(kv, np.arange(4096), 16, 2048)  # blocks of 4 MiB: over PARALLEL_MIN_BYTES
    assert sum(c.kv.nbytes for c in chunks[:128]) >= place.PARALLEL_MIN_BYTES
    copied_on: list[str] = []
    real_copy_all = place._copy_all

    def recording_copy_all(copies: list[place.Copy]) -> None:
        copied_on.append(threading.current_thread().name)
        real_copy_all(copies)

    monkeypatch.setattr(place, "_copy_all", recording_copy_all)
    out = np.zeros_like(kv)
    place_chunks(chunks, out, at_positions=True)
    assert np.array_equal(out, kv)
    if place.parallel_copies():  # a one-core machine copies on the calling thread only
        assert threading.current_thread().name in copied_on
        assert any(name.startswith("kvsieve-copy") for name in copied_on)


def test_gather_chunks_concatenates_in_stream_order(tiny: ModelSpec) -> None:
    kv = make_kv(tiny, 32)
    order = np.random.default_rng(5).permutation(32)
    positions, gathered = gather_chunks(_chunks(kv, order, 4, 16), tiny)
    assert positions.tolist() == order.tolist()
    assert np.array_equal(gathered, kv[:, :, :, order])


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: LoadedChunk(0, 0, c.positions, c.kv[:, :, :, :4], "memory", 0), "does not fit"),
        (lambda c: LoadedChunk(0, 0, c.positions + 60, c.kv, "memory", 0), "outside"),
        (lambda c: LoadedChunk(0, 0, c.positions, c.kv[:1], "memory", 0), "does not fit"),
    ],
    ids=["short kv", "positions past the end", "wrong layers"],
)
def test_bad_chunk_is_named_and_nothing_of_its_block_is_copied(
    tiny: ModelSpec, mutate: object, message: str
) -> None:
    kv = make_kv(tiny, 64)
    chunks = _chunks(kv, np.arange(64), 8, 64)  # one block: the bad chunk stops all of it
    chunks[3] = mutate(chunks[3])  # type: ignore[operator]
    out = np.zeros_like(kv)
    with pytest.raises(InvalidInputError, match=message):
        place_chunks(chunks, out, at_positions=True)
    assert not out.any()


def test_stream_order_past_the_end_of_out_is_refused(tiny: ModelSpec) -> None:
    kv = make_kv(tiny, 32)
    out = np.zeros(tiny.kv_shape(24), kv.dtype)
    with pytest.raises(InvalidInputError, match="more than the 24"):
        place_chunks(_chunks(kv, np.arange(32), 8, 32), out, at_positions=False)
    assert not out.any()


def test_a_real_load_with_importance_order_places_every_token(tmp_path: Path) -> None:
    """Scores reorder tokens inside each block: chunks arrive with scattered positions."""
    config = StoreConfig(data_dir=tmp_path / "data", block_tokens=64, chunk_tokens=16, memory_bytes=64 << 20)
    tokens, kv = make_tokens(256), make_kv(WIDE, 256)
    scores = np.random.default_rng(6).random(256).astype(np.float32)
    with TieredStore(config) as store:
        store.store(tokens, kv, model=WIDE, scores=scores)
    with TieredStore(config) as store:  # restarted: from disk, then again from memory
        for _ in range(2):
            out = np.zeros_like(kv)
            placed = place_chunks(store.load(tokens, model=WIDE), out, at_positions=True)
            assert placed.num_tokens == 256
            assert sorted(placed.positions.tolist()) == list(range(256))
            assert np.array_equal(out, kv)


def test_a_forked_child_places_with_its_own_copy_thread() -> None:
    """The parent's pool thread does not exist in a forked child: the child must not wait on it."""
    kv = make_kv(WIDE, 4096)
    chunks = _chunks(kv, np.arange(4096), 16, 2048)
    place_chunks(chunks, np.zeros_like(kv), at_positions=True)  # the parent's pool now exists
    pid = os.fork()
    if pid == 0:  # child: place again and report by exit code (never run pytest's teardown)
        out = np.zeros_like(kv)
        place_chunks(chunks, out, at_positions=True)
        os._exit(0 if np.array_equal(out, kv) else 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung placing chunks")
    assert os.waitstatus_to_exitcode(status) == 0


def test_chunks_of_no_tokens_are_skipped_anywhere_in_a_block(tiny: ModelSpec) -> None:
    kv = make_kv(tiny, 16)
    chunks = _chunks(kv, np.arange(16), 8, 16)
    empty = LoadedChunk(0, 9, np.zeros(0, np.int64), kv[:, :, :, :0], "memory", 0)
    for at_positions in (True, False):
        out = np.zeros_like(kv)
        placed = place_chunks([empty, chunks[0], empty, chunks[1], empty], out, at_positions=at_positions)
        assert placed.num_tokens == 16
        assert np.array_equal(out, kv)
        only_empty = place_chunks([empty], np.zeros_like(kv), at_positions=at_positions)
        assert only_empty.num_tokens == 0


def test_a_position_named_twice_in_a_block_is_refused(tiny: ModelSpec) -> None:
    kv = make_kv(tiny, 16)
    chunks = _chunks(kv, np.arange(16), 8, 16)
    twice = LoadedChunk(0, 1, chunks[0].positions, chunks[1].kv, "memory", 0)
    out = np.zeros_like(kv)
    with pytest.raises(InvalidInputError, match="same position twice"):
        place_chunks([chunks[0], twice], out, at_positions=True)
    assert not out.any()
