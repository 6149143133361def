"""Stores off the request (engine_adapter/runner/saver.py): a bounded queue on a thread of its own,
drops counted, and a device's new KV stored in pieces of whole blocks."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_adapter.runner import saver as saver_module
from engine_adapter.runner.saver import PIECE_BYTES, BackgroundSaver, piece_ranges
from kvstore.config import StoreConfig
from kvstore.store.tiered import TieredStore


def test_stores_run_in_order_and_flush_waits_for_them() -> None:
    saver = BackgroundSaver(max_bytes=100)
    gate, order = threading.Event(), []

    def store(i: int) -> int:
        gate.wait()
        order.append(i)
        return i

    assert all(saver.submit(10, lambda i=i: store(i)) for i in range(5))
    assert not saver.flush(timeout_s=0.05)  # the gate holds the first store
    gate.set()
    assert saver.flush(timeout_s=10)
    assert order == [0, 1, 2, 3, 4] and saver.stats.blocks == 10 and saver.stats.done == 5


def test_a_full_queue_drops_and_counts_and_a_failure_is_counted() -> None:
    saver = BackgroundSaver(max_bytes=100)
    gate = threading.Event()
    assert saver.submit(60, lambda: gate.wait() and 0)
    assert not saver.submit(60, lambda: 1)  # 120 bytes would pass the bound: dropped, counted
    assert saver.stats.dropped == 1

    def boom() -> int:
        raise RuntimeError("disk full")

    assert saver.submit(40, boom)
    gate.set()
    assert saver.flush(timeout_s=10)
    assert saver.stats.failed == 1 and saver.stats.last_error == "disk full"
    assert saver.submit(10, lambda: 2) and saver.close(timeout_s=10) and saver.stats.blocks == 2
    assert not saver.submit(10, lambda: 3) and saver.stats.dropped == 2  # closed: refused, counted
    with pytest.raises(ValueError, match="max_bytes must be > 0"):
        BackgroundSaver(max_bytes=0)


def test_pieces_are_whole_blocks_under_the_piece_size() -> None:
    token_bytes = 128 << 10  # an 8B model's
    ranges = piece_ranges(512, 32768, 256, token_bytes)
    assert ranges[0][0] == 512 and ranges[-1][1] == 32768
    assert all(b - a <= PIECE_BYTES // token_bytes and a % 256 == 0 for a, b in ranges)
    assert all(b1 == a2 for (_, b1), (a2, _) in itertools.pairwise(ranges))
    assert piece_ranges(0, 1000, None, token_bytes) == [(0, 1000)]  # a sidecar's block size is unknown


@pytest.mark.model
def test_an_engine_stores_in_pieces_behind_the_answer_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine_adapter.runner.device import KVTransfer
    from engine_adapter.runner.engine import Engine
    from engine_adapter.runner.model import load_model

    lm = load_model(quiet=True)
    monkeypatch.setattr(saver_module, "PIECE_BYTES", 2 * 32 * lm.spec.token_bytes)  # two blocks a piece
    prompt = "The keeper wrote about the wind, the ships and the sea. " * 20 + "\n\nWhat did he write?"
    config = StoreConfig(data_dir=tmp_path / "behind", block_tokens=32, chunk_tokens=8)
    with TieredStore(config) as store:
        engine = Engine(
            lm, store, transfer=KVTransfer(torch.device("cpu"), staging=True), background_stores=True
        )
        ids = engine.encode(prompt)
        state = engine.prefill(ids)
        assert state.stored_blocks == len(ids) // 32  # queued
        assert engine.flush_stores(timeout_s=120)
        assert engine.saver is not None and engine.saver.stats.blocks == len(ids) // 32
        _, _, behind = store.load_arrays(ids, model=lm.spec)
    with TieredStore(StoreConfig(data_dir=tmp_path / "inline", block_tokens=32, chunk_tokens=8)) as store:
        Engine(lm, store).prefill(ids)  # the CPU's own path: one store, in line
        _, _, inline = store.load_arrays(ids, model=lm.spec)
    np.testing.assert_array_equal(behind, inline)
