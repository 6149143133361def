"""Stores behind the answer, for real (issue 47, item 3), proved on the CPU.

Through a staged transfer (what a GPU runs; `KVTransfer(staging=True)` runs it on the CPU) the
engine stores a prompt's new blocks on its saver thread. What runs in line with the request is
only the copy of the new KV off the device, issued layer by layer from the cache into a buffer
the engine made when it started: no buffer allocated, no stack of the layers, no encoding, no
disk. Counted per thread, never timed.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine_adapter.runner.device import KVTransfer
from engine_adapter.runner.engine import Engine
from engine_adapter.runner.model import LoadedModel, random_llama, spec_from_config
from kvstore.config import StoreConfig
from kvstore.format import key_summary
from kvstore.load.buffers import StagingPool
from kvstore.store.tiered import TieredStore
from kvstore.store.write import BlockWriter
from kvstore.tiers.arena import HostArena
from kvstore.tiers.disk.lmdb import LmdbTier

BLOCK = 32


def _tiny_lm(tmp_path: Path) -> LoadedModel:
    torch.manual_seed(0)
    model = random_llama((128, 256, 4, 4, 2, 1000), "cpu", torch.float32)
    model.config.max_position_embeddings = 2048  # its download buffers: 2,048 tokens' KV
    return LoadedModel(model, None, spec_from_config(model.config, tmp_path / "m", "float16"), tmp_path / "m")


class ThreadLog:
    """Which threads ran each watched call (and, for `torch.stack`, how many bytes it made)."""

    def __init__(self) -> None:
        self.calls: dict[str, list[str]] = defaultdict(list)

    def watch(self, monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, label: str | None = None) -> None:
        original: Callable[..., Any] = getattr(owner, name)

        def logged(*args: Any, **kwargs: Any) -> Any:
            self.calls[label or name].append(threading.current_thread().name)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, logged)

    def on(self, thread: str) -> dict[str, int]:
        return {name: threads.count(thread) for name, threads in self.calls.items() if thread in threads}


def _watched(monkeypatch: pytest.MonkeyPatch, kv_bytes: int) -> ThreadLog:
    log = ThreadLog()
    log.watch(monkeypatch, BlockWriter, "encode_blocks", "encoding")
    log.watch(monkeypatch, key_summary, "encode_summaries", "summaries")
    log.watch(monkeypatch, LmdbTier, "put_blocks", "disk")
    log.watch(monkeypatch, StagingPool, "_allocate", "staging allocations")
    log.watch(monkeypatch, HostArena, "_new_segment", "arena segments")
    stack = torch.stack

    def watched_stack(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        out = stack(tensors, *args, **kwargs)
        if out.numel() * out.element_size() >= kv_bytes // 2:  # the new KV, stacked whole
            log.calls["KV stacked"].append(threading.current_thread().name)
        return out

    monkeypatch.setattr(torch, "stack", watched_stack)
    return log


def test_the_request_only_issues_the_copy_off_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lm = _tiny_lm(tmp_path)
    ids = np.random.default_rng(3).integers(0, 1000, 12 * BLOCK + 5).tolist()
    config = StoreConfig(data_dir=tmp_path / "kv", block_tokens=BLOCK, chunk_tokens=8, layer_chunk_tokens=8)
    with TieredStore(config) as store:
        transfer = KVTransfer(torch.device("cpu"), staging=True)
        engine = Engine(lm, store, collect_stats=False, transfer=transfer)
        assert engine.saver is not None  # staged: stores go behind the answer
        pool = transfer.copier.pool
        assert pool.wait_ahead()  # made when the engine started, on a thread of their own
        assert pool.made_on == ["kvsieve-staging-ahead"] * 2 and pool.allocations == 0
        log = _watched(monkeypatch, 12 * BLOCK * lm.spec.token_bytes)
        request = threading.current_thread().name
        state = engine.prefill(ids)
        in_line = log.on(request)
        assert engine.flush_stores(30) and store.flush(30)
        behind = dict(log.calls)
        loaded = store.load_arrays(ids[: 12 * BLOCK], model=lm.spec)[2]
    assert state.stored_blocks == 12 and engine.saver.stats.done == 1
    assert in_line == {}  # nothing of storing but issuing the copies ran on the request's thread
    assert set(behind["encoding"]) == {"kvsieve-saver"}
    assert behind["disk"] and request not in behind["disk"]
    assert pool.allocations == 0 and pool.made_on == ["kvsieve-staging-ahead"] * 2
    expected, _ = Engine(lm, None, collect_stats=False).analyze(ids[: 12 * BLOCK])
    np.testing.assert_array_equal(loaded.view(np.uint16), expected.view(np.uint16))  # the KV, bit-exact


def test_a_prompt_of_several_pieces_is_stored_from_the_buffers_made_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pieces of whole blocks: each stored from the buffer its copy landed in while the next is
    copied into the other one; nothing allocated, on any thread, and every block bit-exact."""
    import engine_adapter.runner.saver as saver

    lm = _tiny_lm(tmp_path)
    monkeypatch.setattr(saver, "PIECE_BYTES", 3 * BLOCK * lm.spec.token_bytes)  # 3 blocks a piece
    ids = np.random.default_rng(4).integers(0, 1000, 10 * BLOCK + 1).tolist()
    config = StoreConfig(data_dir=tmp_path / "kv", block_tokens=BLOCK, chunk_tokens=8, layer_chunk_tokens=8)
    with TieredStore(config) as store:
        transfer = KVTransfer(torch.device("cpu"), staging=True)
        engine = Engine(lm, store, collect_stats=False, transfer=transfer)
        assert transfer.copier.pool.wait_ahead()
        state = engine.prefill(ids)
        assert engine.flush_stores(30)
        loaded = store.load_arrays(ids[: 10 * BLOCK], model=lm.spec)[2]
    assert state.stored_blocks == 10 and engine.saver is not None and engine.saver.stats.blocks == 10
    assert transfer.copier.pool.allocations == 0  # four pieces, two buffers, both made ahead
    expected, _ = Engine(lm, None, collect_stats=False).analyze(ids[: 10 * BLOCK])
    np.testing.assert_array_equal(loaded.view(np.uint16), expected.view(np.uint16))


def test_a_take_waits_for_a_buffer_being_made_rather_than_make_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = StagingPool(pin=False)
    release = threading.Event()
    make = StagingPool._make_one

    def slow(self: StagingPool, capacity: int) -> None:
        release.wait(10)
        make(self, capacity)

    monkeypatch.setattr(StagingPool, "_make_one", slow)
    pool.make_ahead(1 << 20)
    taken: list[Any] = []
    taker = threading.Thread(target=lambda: taken.append(pool.take(1 << 20)))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive() and not taken  # waiting for the one under way
    release.set()
    taker.join(10)
    assert not taker.is_alive() and taken and taken[0].numel() == 1 << 20
    assert pool.allocations == 0 and pool.made_ahead == 1 and pool.made_on == ["kvsieve-staging-ahead"]
    assert pool.take(1 << 22) is not None and pool.allocations == 1  # larger: none coming, made here
