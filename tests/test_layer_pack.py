"""Layer packs (layered layout v3): a block's layer records in one value (kvstore/format/layer_pack.py).

Real LMDB and a real redis-server. What is checked: the format refuses every damaged or foreign
table; a store writes packs, loads them bit-exact (raw and zstd, cold and from memory) and
promotes a pack to memory in one piece; a byte range of a layer record is read through the
pack's table (read once per block and local tier); corrupt or forged packs are refused locally
and a counted miss remotely; v2 blocks (a value per layer record) keep loading beside packs.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import TINY, corrupt_chunk, make_kv, make_tokens
from test_hostile_geometry import _forged_layer_record, positional_kv, wrong_tokens

from kvstore.config import StoreConfig
from kvstore.errors import ChecksumError, NotFoundError
from kvstore.format.block_meta import BlockMeta
from kvstore.format.chunk import ChunkId, GeometryError
from kvstore.format.layer_pack import encode_pack, parse_table, split_pack, table_bytes
from kvstore.format.layer_record import encode_layer_record, header_bytes, headers_like, parse_header
from kvstore.keys import chunk_key
from kvstore.store.tiered import TieredStore

B, C = 32, 8  # block tokens; tokens per per-layer chunk
N = 3 * B
Array = np.ndarray[Any, Any]
PACK_ID = ChunkId(b"f" * 16, b"n" * 16, b"k" * 16, 0xC000_0008, 2)


def _config(data_dir: Path | None, **kwargs: Any) -> StoreConfig:
    return StoreConfig(
        data_dir=data_dir, block_tokens=B, chunk_tokens=8, memory_bytes=64 << 20, layout="layered",
        layer_chunk_tokens=C, **kwargs,
    )  # fmt: skip


def _metas(store: TieredStore, toks: Array) -> list[BlockMeta]:
    return [n.payload for n in store.index.match(store._root(TINY, "default"), toks, touch=False).nodes]


def _records(n: int = 2) -> list[bytes]:
    kv = np.random.default_rng(1).standard_normal((n, 2, 2, B, 4)).astype(np.float16)
    return [encode_layer_record(replace(PACK_ID, chunk_index=n + i), kv[i], "float16", C) for i in range(n)]


# -- the format -----------------------------------------------------------------------------


def test_a_pack_splits_into_its_records_and_its_table_is_read_from_a_prefix() -> None:
    records = _records()
    pack = encode_pack(PACK_ID, records)
    table = parse_table(pack[: table_bytes(2)], PACK_ID, 2)  # the table's range is enough
    assert table.offsets[0] == table_bytes(2) and table.lengths == [len(r) for r in records]
    assert [bytes(p) for p in split_pack(pack, table)] == records
    assert table.span(1) == (table_bytes(2) + len(records[0]), len(pack))


@pytest.mark.parametrize(
    ("damage", "error", "match"),
    [
        ("table byte", ChecksumError, "table checksum"),
        ("record byte", ChecksumError, "records checksum"),
        ("truncated", ChecksumError, "is .* bytes, its table says"),
        ("identity", ChecksumError, "identity mismatch"),
        ("layers", GeometryError, "holds 2 layers; the block has 3"),
        ("magic", ChecksumError, "not a kvsieve layer pack"),
    ],
)
def test_a_damaged_or_foreign_pack_is_refused(damage: str, error: type[Exception], match: str) -> None:
    pack = bytearray(encode_pack(PACK_ID, _records()))
    expect, layers = PACK_ID, 2
    if damage == "table byte":
        pack[table_bytes(2) - 12] ^= 1  # an entry of the table
    elif damage == "record byte":
        pack[-3] ^= 1  # a chunk of layer 1: its own checksum would catch it too, the pack's does first
    elif damage == "truncated":
        pack = pack[:-1]
    elif damage == "identity":
        expect = replace(PACK_ID, block_key=b"x" * 16)
    elif damage == "layers":
        layers = 3
    else:
        pack[:4] = b"KVSL"
    with pytest.raises(error, match=match):
        split_pack(pack, parse_table(pack, expect, layers))


# -- a store of packs ----------------------------------------------------------------------


@pytest.fixture(params=["raw", "shuffle-zstd"])
def stored(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[StoreConfig, Array, Array]]:
    config = _config(tmp_path / "data", codec=request.param)
    toks, kv = make_tokens(N, seed=3), make_kv(TINY, N, seed=3)
    with TieredStore(config) as store:
        assert store.store(toks, kv, model=TINY).new_blocks == 3
        for meta in _metas(store, toks):
            assert meta.is_packed and meta.num_chunks == TINY.num_layers + 1
    yield config, toks, kv


def test_a_cold_full_load_is_bit_exact_and_promotes_each_pack_whole(
    stored: tuple[StoreConfig, Array, Array],
) -> None:
    config, toks, kv = stored
    with TieredStore(config) as store:  # restarted: memory is empty
        for tier in ("lmdb", "memory"):
            _, positions, out = store.load_arrays(toks, model=TINY)
            np.testing.assert_array_equal(positions, np.arange(N))
            np.testing.assert_array_equal(out, kv)
            assert store.stats().counters[f"chunk_hits.{tier}"] == 3  # one value a block
        for meta in _metas(store, toks):
            assert store.memory.has_chunk(meta.key, meta.pack_index)
            assert not store.memory.has_chunk(meta.key, meta.record_index(1, 0) + 1)  # nothing else
            held = store.memory.get_chunks(meta, [meta.pack_index])[0]
            assert held is not None
            records = split_pack(held, parse_table(held, meta.chunk_id(meta.pack_index), TINY.num_layers))
            raw = header_bytes(B // C) + B * TINY.token_bytes // TINY.num_layers
            assert [len(r) for r in records] == [raw] * TINY.num_layers  # memory holds raw records


def test_a_pack_read_layer_by_layer_is_promoted_once_its_last_layer_is_verified(tmp_path: Path) -> None:
    config = _config(tmp_path / "data")
    toks, kv = make_tokens(N, seed=4), make_kv(TINY, N, seed=4)
    with TieredStore(config) as store:
        store.store(toks, kv, model=TINY)
    with TieredStore(config) as store, store.open_layers(toks, model=TINY) as load:
        first = _metas(store, toks)[0]
        everything = list(range(N // C))
        np.testing.assert_array_equal(load.read_layer(0, everything).kv, kv[0])
        assert not store.memory.has_chunk(first.key, first.pack_index)  # one layer of two: not yet
        np.testing.assert_array_equal(load.read_layer(1, everything).kv, kv[1])
        assert store.memory.has_chunk(first.key, first.pack_index)
    with TieredStore(config) as store:  # and what it promoted loads bit-exact
        assert store.load_arrays(toks, model=TINY)[2].tobytes() == kv.tobytes()


def test_a_byte_range_from_disk_reads_its_header_and_chunk_and_no_pack_table(tmp_path: Path) -> None:
    """The pack's place in the data file is located (no byte read); a layer record's place in it
    follows from the geometry, and the header read beside the chunk proves it (identity, checksum)."""
    config = _config(tmp_path / "data")
    toks, kv = make_tokens(N, seed=5), make_kv(TINY, N, seed=5)
    with TieredStore(config) as store:
        store.store(toks, kv, model=TINY)
    chunk_bytes = TINY.token_bytes // TINY.num_layers * C
    with TieredStore(config) as store:
        read = []
        for _ in range(2):
            before = store.stats().counters.get("bytes_read.lmdb", 0)
            with store.open_layers(toks, model=TINY) as load:
                got = load.read_layer(1, [B // C + 1])  # block 1's chunk 1: a byte range
                np.testing.assert_array_equal(got.kv, kv[1][:, :, B + C : B + 2 * C])
                assert got.positions.tolist() == list(range(B + C, B + 2 * C))
            read.append(store.stats().counters["bytes_read.lmdb"] - before)
        assert read == [header_bytes(B // C) + chunk_bytes] * 2


def test_a_corrupt_pack_on_disk_is_a_checksum_error_and_its_block_is_forgotten(tmp_path: Path) -> None:
    config = _config(tmp_path / "data")
    toks, kv = make_tokens(N, seed=6), make_kv(TINY, N, seed=6)
    with TieredStore(config) as store:
        store.store(toks, kv, model=TINY)
        second = _metas(store, toks)[1]
    corrupt_chunk(config, second.key, second.pack_index, offset=-5)  # layer 1's last chunk
    with TieredStore(config) as store:
        covered, _, out = store.load_arrays(toks, model=TINY)  # a load: the rest is a miss
        assert covered == B and out.tobytes() == kv[:, :, :, :B].tobytes()
        assert store.stats().counters["checksum_failures"] == 1
        assert store.lookup(toks, model=TINY).num_tokens == B  # the block and those after it are gone
    corrupt_chunk(config, _metas_of(config, toks)[0].key, second.pack_index, offset=-5)
    with TieredStore(config) as store, store.open_layers(toks, model=TINY) as load:
        with pytest.raises(ChecksumError, match="checksum mismatch"):  # read by ranges: the chunk's own
            load.read_layer(1, [B // C - 1])
        assert store.lookup(toks, model=TINY).num_tokens == 0


def _metas_of(config: StoreConfig, toks: Array) -> list[BlockMeta]:
    with TieredStore(config) as store:
        return _metas(store, toks)


def _rewrite_pack(config: StoreConfig, meta: BlockMeta, pack: bytes) -> None:
    import lmdb

    env = lmdb.open(str(config.lmdb_dir), max_dbs=4, map_size=1 << 30)
    with env.begin(write=True, db=env.open_db(b"chunks")) as txn:
        key = chunk_key(meta.key, meta.layout_version, meta.pack_index)
        assert txn.get(key) is not None
        txn.put(key, pack)
    env.close()


def _forged_pack(meta: BlockMeta, how: str) -> bytes:
    """`meta`'s pack with a valid table, checksums and identity, but layer 1's record of another
    geometry (`how`, as test_hostile_geometry.py forges records), or layer 1's record in layer 0's slot."""
    kv = positional_kv(TINY, N, writer=9)[:, :, :, meta.start : meta.start + B]
    ids = [meta.chunk_id(meta.record_index(layer, 0)) for layer in range(TINY.num_layers)]
    records = [encode_layer_record(ids[layer], kv[layer], TINY.dtype, C) for layer in range(TINY.num_layers)]
    if how == "swapped":
        records.reverse()
    else:
        records[1] = _forged_layer_record(meta, 1, how)
    return encode_pack(meta.chunk_id(meta.pack_index), records)


@pytest.mark.parametrize("how", ["chunk_tokens", "kv_heads", "swapped"])
def test_a_forged_pack_on_disk_is_refused_and_its_block_dropped(tmp_path: Path, how: str) -> None:
    config = _config(tmp_path / "data")
    toks = make_tokens(N, seed=7)
    with TieredStore(config) as store:
        store.store(toks, positional_kv(TINY, N, writer=1), model=TINY)
        meta = _metas(store, toks)[1]
    _rewrite_pack(config, meta, _forged_pack(meta, how))
    with TieredStore(config) as store:
        covered, positions, kv = store.load_arrays(toks, model=TINY)
        assert covered == B and wrong_tokens(positions, kv, {1}) == 0  # block 0 only: never a forged token
        assert store.stats().get("geometry_mismatches") == 1  # swapped: another layer's identity
        assert store.lookup(toks, model=TINY).num_tokens == B


@pytest.fixture
def remote(redis_url: str) -> Iterator[tuple[str, Any]]:
    import redis

    client = redis.Redis.from_url(redis_url)
    yield uuid.uuid4().hex, client
    client.close()


@pytest.mark.parametrize("read", ["load", "layers"])
def test_a_forged_remote_pack_is_a_counted_miss_and_deleted(
    tmp_path: Path, redis_url: str, remote: tuple[str, Any], read: str
) -> None:
    prefix, redis_client = remote
    toks = make_tokens(N, seed=8)
    with TieredStore(_config(tmp_path / "w", remote_url=redis_url, remote_prefix=prefix)) as writer:
        writer.store(toks, positional_kv(TINY, N, writer=1), model=TINY)
        meta = _metas(writer, toks)[1]
    key = f"{prefix}:{{{meta.key.hex()}}}:c:{meta.layout_version}:{meta.pack_index}".encode()  # docs/keys.md
    assert redis_client.exists(key)
    redis_client.set(key, _forged_pack(meta, "kv_heads"))
    with TieredStore(_config(tmp_path / "r", remote_url=redis_url, remote_prefix=prefix)) as reader:
        if read == "load":
            covered, positions, kv = reader.load_arrays(toks, model=TINY)
            assert covered == B and wrong_tokens(positions, kv, {1}) == 0
        else:  # a byte range of layer 1: the header in it is the forged one
            with (
                reader.open_layers(toks, model=TINY) as load,
                pytest.raises(NotFoundError, match=meta.key.hex()),
            ):
                load.read_layer(1, [B // C + 1])
        stats = reader.stats()
        assert stats.get("geometry_mismatches") == 1 and stats.get("remote.corrupt") == 1
        assert not redis_client.exists(key)  # wrong for every reader: deleted there
        assert reader.lookup(toks, model=TINY).num_tokens == B


def test_v2_blocks_keep_loading_beside_packs(tmp_path: Path) -> None:
    toks, kv = make_tokens(N, seed=9), make_kv(TINY, N, seed=9)
    with TieredStore(_config(tmp_path / "data", layered_pack=False)) as old:
        old.store(toks[: 2 * B], kv[:, :, :, : 2 * B], model=TINY)
    with TieredStore(_config(tmp_path / "data")) as store:  # upgraded: new blocks are packed
        assert store.store(toks, kv, model=TINY).new_blocks == 1
        assert [m.is_packed for m in _metas(store, toks)] == [False, False, True]
    with TieredStore(_config(tmp_path / "data")) as store:
        for _ in range(2):  # from disk, then from memory
            _, positions, out = store.load_arrays(toks, model=TINY)
            assert positions.tolist() == list(range(N)) and out.tobytes() == kv.tobytes()
        with store.open_layers(toks, model=TINY) as load:
            chosen = [0, B // C + 2, 2 * B // C + 3]  # one chunk of each block
            got = load.read_layer(1, chosen)
            np.testing.assert_array_equal(got.kv, kv[1][:, :, got.positions])
            assert got.positions[::C].tolist() == [c * C for c in chosen]


def test_headers_checked_at_once_are_the_headers_parsed_one_by_one() -> None:
    records = _records(3)
    pack = memoryview(encode_pack(PACK_ID, records))
    table = parse_table(pack, PACK_ID, 3)
    stride = table.offsets[1] - table.offsets[0]
    first = parse_header(records[0])
    indices = [3, 4, 5]
    assert headers_like(first, pack, table.offsets[0], stride, indices) == [parse_header(r) for r in records]
    assert headers_like(first, pack, table.offsets[0], stride, [3, 5, 4]) is None  # another layer's index
    forged = bytearray(pack)
    forged[table.offsets[2] + 66] ^= 1  # record 2's head dim: its header checksum is not what is compared
    assert headers_like(first, memoryview(forged), table.offsets[0], stride, indices) is None
    assert headers_like(first, pack, table.offsets[0], stride + 2, indices) is None  # misaligned
