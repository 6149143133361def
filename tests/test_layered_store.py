"""The layered layout in the embedded store: writes, `load` over it, `open_layers`, mixed prefixes.

Real LMDB under tmp_path, a memory-only store, and a real Redis for the shared tier.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from importance.lowbit import dequantize, quantize
from kvstore.api import LayeredLoad, PrefixStore
from kvstore.config import StoreConfig
from kvstore.errors import ChecksumError, InvalidInputError
from kvstore.format.block_meta import BlockMeta, identity_error
from kvstore.format.key_summary import summary_record_bytes
from kvstore.format.layer_pack import table_bytes
from kvstore.format.layer_record import header_bytes
from kvstore.store.tiered import TieredStore
from tests.conftest import TINY, corrupt_chunk, make_kv, make_tokens

B, C = 32, 8  # block tokens; tokens per per-layer chunk
N = 3 * B
Array = np.ndarray[Any, Any]


def _config(tmp_path: Path | None, **kwargs: Any) -> StoreConfig:
    return StoreConfig(
        data_dir=None if tmp_path is None else tmp_path / "data", block_tokens=B, chunk_tokens=16,
        memory_bytes=64 << 20, layout="layered", layer_chunk_tokens=C, **kwargs,
    )  # fmt: skip


@pytest.fixture(params=["lmdb-raw", "lmdb-zstd", "memory", "lmdb-raw-v2", "lmdb-zstd-v2"])
def layered(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TieredStore]:
    """A layered store: packs (layout v3, what stores write), or v2 (a value per layer record)."""
    codec = "shuffle-zstd" if "zstd" in request.param else "raw"
    data = None if request.param == "memory" else tmp_path
    with TieredStore(_config(data, codec=codec, layered_pack="v2" not in request.param)) as store:
        yield store


def _stored(store: TieredStore, seed: int = 0) -> tuple[Array, Array, Array]:
    toks, kv = make_tokens(N, seed), make_kv(TINY, N, seed)
    scores = np.random.default_rng(seed + 7).random(N).astype(np.float32)
    assert store.store(toks, kv, model=TINY, scores=scores).new_blocks == 3
    return toks, kv, scores


def _metas(store: TieredStore, toks: Array) -> list[BlockMeta]:
    return [n.payload for n in store.index.match((store._root(TINY, "default")), toks, touch=False).nodes]


def test_layered_blocks_record_their_layout_and_records(layered: TieredStore) -> None:
    assert (layered.info.block_tokens, layered.info.chunk_tokens) == (B, C)
    toks, _, scores = _stored(layered)
    for i, meta in enumerate(_metas(layered, toks)):
        assert meta.is_layered and meta.layout == "layered" and meta.num_layers == TINY.num_layers
        # a summary per layer, then a layer record per layer (v2) or one pack of them (v3)
        assert meta.num_chunks == (TINY.num_layers + 1 if meta.is_packed else 2 * TINY.num_layers)
        assert meta.is_packed == layered.config.layered_pack
        np.testing.assert_array_equal(meta.permutation, np.arange(B))
        np.testing.assert_array_equal(meta.scores, scores[i * B : (i + 1) * B])
        assert BlockMeta.from_bytes(meta.to_bytes()).layout == "layered"


def test_full_load_is_bit_exact(layered: TieredStore) -> None:
    toks, kv, _ = _stored(layered)
    for _ in range(2):  # from the tier written, then from memory after promotion
        with layered.load(toks, model=TINY) as stream:
            positions, out = stream.gather(TINY)
        np.testing.assert_array_equal(positions, np.arange(N))
        np.testing.assert_array_equal(out, kv)
        assert stream.delivered_fraction == 1.0
        summaries = 3 * TINY.num_layers * summary_record_bytes(B, TINY.num_kv_heads, TINY.head_dim)
        if layered.config.codec == "raw":  # (memory holds zstd chunks uncompressed: other sizes)
            assert stream.bytes_read == stream.prefix_bytes - summaries  # load() reads no summary


def test_restarted_layered_store_loads_bit_exact(tmp_path: Path) -> None:
    with TieredStore(_config(tmp_path, codec="shuffle-zstd")) as store:
        toks, kv, _ = _stored(store)
    with TieredStore(_config(tmp_path)) as store:
        assert store.orphans == 0
        _, positions, out = store.load_arrays(toks, model=TINY)
    np.testing.assert_array_equal(positions, np.arange(N))
    np.testing.assert_array_equal(out, kv)


@pytest.mark.parametrize("budget", [0.1, 0.25, 0.5, "auto"])
def test_partial_load_stays_within_budget_at_true_positions(layered: TieredStore, budget: Any) -> None:
    toks, kv, scores = _stored(layered)
    with layered.load(toks, model=TINY, budget=budget) as stream:
        chunks = list(stream)
    positions = np.concatenate([c.positions for c in chunks])
    if budget != "auto":
        assert stream.delivered_tokens == len(positions) <= math.ceil(budget * N) + C - 1
    assert len(set(positions.tolist())) == len(positions) and len(positions) % C == 0
    for chunk in chunks:  # every token's KV is the stored KV of its true position, all layers
        assert chunk.kv.shape == (TINY.num_layers, 2, TINY.num_kv_heads, C, TINY.head_dim)
        np.testing.assert_array_equal(chunk.kv, kv[:, :, :, chunk.positions])
        np.testing.assert_array_equal(chunk.positions % C, np.arange(C))  # one prompt-order run
    assert stream.bytes_read == sum(c.nbytes for c in chunks)
    assert stream.read_fraction == pytest.approx(stream.bytes_read / stream.prefix_bytes)
    if budget == 0.25:  # the best-scored 8-token runs, as select_chunks ranks them
        means = scores.reshape(-1, C).mean(axis=1)
        assert set(positions // C) == set(np.argsort(-means, kind="stable")[: N // 4 // C].tolist())


def test_open_layers_summaries_are_lowbit_of_the_stored_keys(layered: TieredStore) -> None:
    toks, kv, _ = _stored(layered)
    with layered.open_layers(toks, model=TINY) as load:
        assert isinstance(load, LayeredLoad)
        assert (load.matched_tokens, load.chunk_tokens, load.num_layers) == (N, C, TINY.num_layers)
        one = summary_record_bytes(B, TINY.num_kv_heads, TINY.head_dim)
        assert load.summary_bytes == 3 * TINY.num_layers * one
        assert load.prefix_bytes == sum(m.nbytes for m in _metas(layered, toks))
        for layer in range(TINY.num_layers):
            expected = [dequantize(quantize(kv[layer, 0, :, b * B : (b + 1) * B].astype(np.float32), 2, B))
                        for b in range(3)]  # fmt: skip
            got = load.key_summary(layer)
            assert got.dtype == np.float32 and got.shape == (TINY.num_kv_heads, N, TINY.head_dim)
            np.testing.assert_array_equal(got, np.concatenate(expected, axis=1))
            # later layers' summaries and layer-record headers may be read ahead already
            # (kvstore/load/ahead.py), each once
            headers = 3 * TINY.num_layers * header_bytes(B // C)
            assert (layer + 1) * 3 * one <= load.bytes_read <= load.summary_bytes + headers
        read = load.bytes_read
        load.key_summary(0)  # read once per layer
        assert load.bytes_read == read and load.delivered_tokens == 0
        assert read in (load.summary_bytes, load.summary_bytes + headers)  # headers: all or none


def test_read_layer_returns_exactly_the_stored_kv(layered: TieredStore) -> None:
    toks, kv, _ = _stored(layered)
    with layered.open_layers(toks, model=TINY) as load:
        layer_slice = load.read_layer(1, [9, 0, 4, 5])
        expected = np.concatenate([np.arange(c * C, (c + 1) * C) for c in (0, 4, 5, 9)])
        np.testing.assert_array_equal(layer_slice.positions, expected)
        assert layer_slice.positions.dtype == np.int64 and layer_slice.kv.dtype == TINY.np_dtype
        np.testing.assert_array_equal(layer_slice.kv, kv[1][:, :, expected])
        assert load.delivered_tokens == 4 * C and load.delivered_fraction == 4 * C / N
        first = load.bytes_read
        assert first > 0 and load.read_fraction == first / load.prefix_bytes
        everything = load.read_layer(0, range(N // C))
        np.testing.assert_array_equal(everything.kv, kv[0])
        assert load.delivered_fraction == (4 * C + N) / (2 * N)
        assert load.read_layer(0, []).kv.shape == (2, TINY.num_kv_heads, 0, TINY.head_dim)


def test_open_layers_pins_its_blocks_until_closed(layered: TieredStore) -> None:
    toks, _, _ = _stored(layered)
    assert layered.flush(30)  # a block waiting for its group commit is pinned until then
    load = layered.open_layers(toks, model=TINY)
    keys = [m.key for m in _metas(layered, toks)]
    assert all(layered.tree.is_pinned(k) for k in keys)
    load.close()
    load.close()  # idempotent: unpins once
    assert not any(layered.tree.is_pinned(k) for k in keys)


def test_read_from_disk_is_promoted_to_memory(tmp_path: Path) -> None:
    """Layout v2: each layer record read whole is promoted on its own (packs: test_layer_pack.py)."""
    with TieredStore(_config(tmp_path, layered_pack=False)) as store:
        toks, kv, _ = _stored(store)
    with TieredStore(_config(tmp_path, layered_pack=False)) as store:  # restarted: memory is empty
        for expected_tier in ("lmdb", "memory"):
            with store.open_layers(toks, model=TINY) as load:
                load.key_summary(0)  # all of block 0's layer 0: its layer record is read whole
                np.testing.assert_array_equal(load.read_layer(0, [0, 1, 2, 3]).kv, kv[0][:, :, :32])
            counters = store.stats().counters
            hits = counters[f"summary_hits.{expected_tier}"]  # + layers read ahead (ahead.py)
            assert hits >= 3 and hits % 3 == 0
            # the record read whole, + headers read ahead (from disk: never promoted)
            assert counters[f"chunk_hits.{expected_tier}"] >= 1
            assert store.memory.has_chunk(_metas(store, toks)[0].key, TINY.num_layers)
        before = store.stats().counters["chunk_hits.lmdb"]
        for _ in range(2):  # one chunk of block 1: header and chunk ranges, never promoted
            with store.open_layers(toks, model=TINY) as load:
                chunk_bytes = 2 * TINY.num_kv_heads * C * TINY.head_dim * 2
                np.testing.assert_array_equal(load.read_layer(0, [5]).kv, kv[0][:, :, 40:48])
                assert load.bytes_read == header_bytes(B // C) + chunk_bytes
                np.testing.assert_array_equal(load.read_layer(0, [6]).kv, kv[0][:, :, 48:56])
                assert load.bytes_read == header_bytes(B // C) + 2 * chunk_bytes  # the header is kept
        assert store.stats().counters["chunk_hits.lmdb"] == before + 2  # a hit per header read
        assert not store.memory.has_chunk(_metas(store, toks)[1].key, TINY.num_layers)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda load: load.key_summary(-1), r"layer must be an integer in \[0, 2\), got -1"),
        (lambda load: load.key_summary(2), "layer .* got 2"),
        (lambda load: load.read_layer(True, [0]), "layer .* got True"),
        (lambda load: load.read_layer(0, [12]), r"chunks must be integers in \[0, 12\), got 12"),
        (lambda load: load.read_layer(0, [-1]), "chunks .* got -1"),
        (lambda load: load.read_layer(0, [3, 3]), "must not repeat"),
        (lambda load: load.read_layer(0, [1.0]), "chunks .* got 1.0"),
    ],
)
def test_bad_layer_or_chunk_is_refused_by_name(layered: TieredStore, call: Any, message: str) -> None:
    toks, _, _ = _stored(layered)
    with layered.open_layers(toks, model=TINY) as load:
        with pytest.raises(InvalidInputError, match=message):
            call(load)
        assert load.bytes_read == 0


@pytest.mark.parametrize("record", ["summary", "header", "chunk"])
def test_corrupt_record_is_a_checksum_error_and_the_block_is_forgotten(tmp_path: Path, record: str) -> None:
    """Layout v2's records (a pack's: test_layer_pack.py)."""
    config = _config(tmp_path, layered_pack=False)
    with TieredStore(config) as store:
        toks, _, _ = _stored(store)
        second = _metas(store, toks)[1]
    index = 1 if record == "summary" else second.record_index(1, 0)
    corrupt_chunk(config, second.key, index, offset=20 if record == "header" else None)
    with TieredStore(config) as store, store.open_layers(toks, model=TINY) as load:
        with pytest.raises(ChecksumError, match=second.key.hex()):
            if record == "summary":
                load.key_summary(1)
            else:  # two of the block's four chunks: read as ranges (the middle byte is in one of them)
                load.read_layer(1, [B // C + 1, B // C + 2])
        assert store.lookup(toks, model=TINY).num_tokens == B  # the block and those after it are gone
        assert store.stats().counters["checksum_failures"] == 1


def test_importance_blocks_still_load_in_a_layered_store(tmp_path: Path) -> None:
    old = replace(_config(tmp_path), layout="importance")
    toks, kv = make_tokens(N), make_kv(TINY, N)
    with TieredStore(old) as store:
        store.store(toks[: 2 * B], kv[:, :, :, : 2 * B], model=TINY)
    with TieredStore(_config(tmp_path)) as store:  # upgraded: new blocks are layered
        assert store.store(toks, kv, model=TINY).new_blocks == 1
        assert [m.layout for m in _metas(store, toks)] == ["importance", "importance", "layered"]
        _, positions, out = store.load_arrays(toks, model=TINY)
        np.testing.assert_array_equal(positions, np.arange(N))
        np.testing.assert_array_equal(out, kv)
        with store.open_layers(toks, model=TINY) as load:  # the first block is not layered
            assert (load.matched_tokens, load.prefix_bytes) == (0, 0)
            assert load.key_summary(0).shape == (TINY.num_kv_heads, 0, TINY.head_dim)
            with pytest.raises(InvalidInputError, match=r"\[0, 0\)"):
                load.read_layer(0, [0])


def test_layered_run_stops_at_the_first_importance_block(tmp_path: Path) -> None:
    toks, kv = make_tokens(N), make_kv(TINY, N)
    with TieredStore(_config(tmp_path)) as store:
        store.store(toks[:B], kv[:, :, :, :B], model=TINY)
    with TieredStore(replace(_config(tmp_path), layout="importance")) as store:
        store.store(toks, kv, model=TINY)
        with store.open_layers(toks, model=TINY) as load:
            assert load.matched_tokens == B
            np.testing.assert_array_equal(load.read_layer(1, [3]).kv, kv[1][:, :, 24:32])
        _, _, out = store.load_arrays(toks, model=TINY, budget=1.0)
        np.testing.assert_array_equal(out, kv)


def test_layered_blocks_travel_through_the_remote_tier(tmp_path: Path, redis_url: str) -> None:
    remote = {
        "remote_url": redis_url,
        "remote_prefix": f"layered-{tmp_path.name}",
        "remote_write_behind": False,
    }
    with TieredStore(_config(None, **remote)) as writer:
        toks, kv, _ = _stored(writer)
    with TieredStore(_config(None, **remote)) as reader:  # learns the blocks from Redis
        with reader.open_layers(toks, model=TINY) as load:
            assert load.matched_tokens == N
            np.testing.assert_array_equal(load.read_layer(0, [5]).kv, kv[0][:, :, 40:48])
            assert load.key_summary(1).shape == (TINY.num_kv_heads, N, TINY.head_dim)
        assert reader.stats().counters["summary_hits.redis"] == 3
        _, _, out = reader.load_arrays(toks, model=TINY)
        np.testing.assert_array_equal(out, kv)


def test_both_stores_satisfy_the_protocol() -> None:
    from kvstore.client.kvclient import KVClient
    from kvstore.client.layer_by_layer import EmptyLayeredLoad

    with KVClient("127.0.0.1:9", use_shm=False) as client:  # no call is made
        assert isinstance(client, PrefixStore)
    with EmptyLayeredLoad(TINY) as load:  # what a server without LoadLayers gives
        assert isinstance(load, LayeredLoad) and load.matched_tokens == 0
        with pytest.raises(InvalidInputError, match="layer"):
            load.key_summary(TINY.num_layers)


def test_memory_cache_evicts_and_promotes_per_record(tmp_path: Path) -> None:
    with TieredStore(_config(tmp_path)) as probe:
        toks, kv, _ = _stored(probe)
        block_bytes = _metas(probe, toks)[0].nbytes
    with TieredStore(replace(_config(tmp_path), memory_bytes=block_bytes + block_bytes // 2)) as store:
        for budget in (1.0, 0.5, 1.0):
            with store.load(toks, model=TINY, budget=budget) as stream:
                chunks = list(stream)
            for chunk in chunks:
                np.testing.assert_array_equal(chunk.kv, kv[:, :, :, chunk.positions])
        with store.open_layers(toks, model=TINY) as load:
            np.testing.assert_array_equal(load.read_layer(0, range(N // C)).kv, kv[0])
            load.key_summary(1)
        stats = store.stats()
        assert stats.counters["evictions.memory"] > 0 and stats.counters["chunk_hits.memory"] > 0
        assert stats.tiers["memory"].used_bytes <= block_bytes + block_bytes // 2


def test_memory_only_store_evicts_whole_layered_blocks(tmp_path: Path) -> None:
    with TieredStore(_config(None)) as probe:
        toks, kv, _ = _stored(probe)
        block_bytes = _metas(probe, toks)[0].nbytes
    with TieredStore(replace(_config(None), memory_bytes=4 * block_bytes)) as store:
        first, _, _ = _stored(store, seed=1)
        toks, kv, _ = _stored(store, seed=2)  # needs room: the first prompt's blocks go
        assert store.lookup(first, model=TINY).num_tokens < N
        _, positions, out = store.load_arrays(toks, model=TINY)
        np.testing.assert_array_equal(positions, np.arange(N))
        np.testing.assert_array_equal(out, kv)
        with store.open_layers(toks, model=TINY) as load:
            np.testing.assert_array_equal(load.read_layer(1, [3]).kv, kv[1][:, :, 24:32])


def test_too_many_records_per_block_is_refused_before_anything_is_stored(tmp_path: Path) -> None:
    wide = replace(TINY, num_layers=4096)  # 4096 x (1 + 32 / 1) records: over the u16 chunk index
    config = replace(_config(tmp_path), layer_chunk_tokens=1)
    with TieredStore(config) as store:
        toks, kv = make_tokens(B), make_kv(wide, B)
        with pytest.raises(InvalidInputError, match="layer_chunk_tokens 1 gives 135168 records"):
            store.store(toks, kv, model=wide)
        assert store.lookup(toks, model=wide).num_tokens == 0


def test_importance_records_are_written_as_before_and_bad_layered_records_refused(tmp_path: Path) -> None:
    with TieredStore(replace(_config(tmp_path), layout="importance")) as store:
        toks, _, _ = _stored(store)
        old = _metas(store, toks)[0]
    assert (
        b'"layout"' not in old.to_bytes()
        and BlockMeta.from_bytes(old.to_bytes(version=1)).layout == "importance"
    )
    layered = replace(old, layout="layered", num_layers=2, chunk_tokens=C, permutation=np.arange(B))
    assert BlockMeta.from_bytes(layered.to_bytes()).num_chunks == 2 * 2
    scrambled = replace(layered, permutation=np.roll(np.arange(B), 1))
    with pytest.raises(ChecksumError, match="not in prompt order"):
        BlockMeta.from_bytes(scrambled.to_bytes())
    assert identity_error(replace(old, layout="columns")) == "unknown layout 'columns'"


@pytest.mark.parametrize("use_shm", [False, True])
def test_sidecar_serves_layered_blocks(tmp_path: Path, use_shm: bool) -> None:
    from kvstore.client.kvclient import KVClient
    from kvstore.server.app import start
    from kvstore.server.config import ServerConfig
    from tests.conftest import ServerInThread

    server = ServerInThread(start(ServerConfig(listen="127.0.0.1:0", metrics_listen=""), _config(tmp_path)))
    try:
        toks, kv = make_tokens(N), make_kv(TINY, N)
        with KVClient(server.address, use_shm=use_shm) as client:
            client.store(toks, kv, model=TINY)
            with client.load(toks, model=TINY) as stream:
                positions, out = stream.gather(TINY)
            np.testing.assert_array_equal(positions, np.arange(N))
            np.testing.assert_array_equal(out, kv)
            with client.load(toks, model=TINY, budget=0.25) as stream:
                positions, out = stream.gather(TINY)
            assert len(positions) == N // 4
            np.testing.assert_array_equal(out, kv[:, :, :, positions])
    finally:
        server.stop()
    with TieredStore(_config(tmp_path)) as store:
        assert all(m.is_layered for m in _metas(store, toks))


@pytest.mark.parametrize("budget", [0.25, 0.5, 0.75])
def test_a_partial_load_from_disk_reads_only_what_it_delivers(tmp_path: Path, budget: float) -> None:
    """A budget means bytes: a layer record is read whole only when every chunk is wanted."""
    with TieredStore(_config(tmp_path)) as store:
        toks, _, _ = _stored(store)
    # a header per block and layer, and a pack's table per block, at most
    headers = 3 * TINY.num_layers * header_bytes(B // C) + 3 * table_bytes(TINY.num_layers)
    chunk_bytes = TINY.token_bytes // TINY.num_layers * C  # raw: one layer's K and V of C tokens
    with TieredStore(_config(tmp_path)) as store:  # a fresh store: memory is empty, reads hit LMDB
        with store.load(toks, model=TINY, budget=budget) as stream:
            stream.gather(TINY)
            assert stream.delivered_fraction <= budget
            assert stream.bytes_read <= stream.delivered_tokens * TINY.token_bytes + headers
        metas = _metas(store, toks)
        # a block whose pack the load promoted to memory is copied from there, its header unread
        on_disk = [not store.tiers.memory.has_chunk(m.key, m.pack_index) for m in metas[:2]]
        with store.open_layers(toks, model=TINY) as load:
            before = load.bytes_read
            load.read_layer(1, [0, 5, 6])  # three chunks of one layer, in blocks 0 and 1
            assert load.bytes_read - before == 3 * chunk_bytes + sum(on_disk) * header_bytes(B // C)
