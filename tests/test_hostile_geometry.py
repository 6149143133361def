"""Records whose header geometry disagrees with their block: never used, a counted miss, the block dropped.

Issue #23, item 1. Real components only: a real redis-server shared by real `kvsieve serve`
processes of different `layer_chunk_tokens`, and records forged straight into Redis and LMDB
with a valid checksum and identity but another chunk size, chunk count, layer, dtype, kv head
count or head dim. What a user sees is checked: the KV delivered at every position is the KV a
writer stored for that position, errors are clean statuses (never INTERNAL), and the counters.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import TINY, make_tokens

from bench.common.sidecar import Sidecar
from kvstore.client.kvclient import KVClient
from kvstore.config import StoreConfig
from kvstore.errors import ChecksumError, NotFoundError, RpcFailedError
from kvstore.format.block_meta import BlockMeta, identity_error, layered_layout_version
from kvstore.format.chunk import GeometryError, encode_chunk
from kvstore.format.layer_record import encode_layer_record
from kvstore.keys import chunk_key
from kvstore.model import ModelSpec
from kvstore.store.tiered import TieredStore

B = 32  # block tokens of every store here (bench.common.sidecar.Sidecar's too)
N = 3 * B
Array = np.ndarray[Any, Any]


def positional_kv(model: ModelSpec, num_tokens: int, writer: int) -> Array:
    """KV whose every vector names what it is: channel 0 the token's position, 1 the writer, 2 the
    layer, 3 K/V and head. Exact in fp16 (integers below 2048)."""
    kv = np.zeros(model.kv_shape(num_tokens), np.float32)
    kv[..., 0] = np.arange(num_tokens)
    kv[..., 1] = writer
    kv[..., 2] = np.arange(model.num_layers)[:, None, None, None]
    kv[..., 3] = (np.arange(2)[:, None] * model.num_kv_heads + np.arange(model.num_kv_heads))[
        None, :, :, None
    ]
    return kv.astype(model.np_dtype)


def wrong_tokens(positions: Array, kv: Array, writers: set[int], layer: int | None = None) -> int:
    """Delivered tokens whose KV is not what a writer in `writers` stored at their position.
    `kv`: (layers, 2, heads, n, dim), or one layer's (2, heads, n, dim) with `layer` given."""
    all_layers = kv[None] if layer is not None else kv
    layers = [layer] if layer is not None else list(range(kv.shape[0]))
    wrong = np.zeros(len(positions), bool)
    for i, lyr in enumerate(layers):
        vectors = all_layers[i].astype(np.float32)  # (2, heads, n, dim)
        wrong |= np.any(vectors[..., 0] != np.asarray(positions)[None, None, :], axis=(0, 1))
        wrong |= np.any(vectors[..., 2] != lyr, axis=(0, 1))
        wrong |= ~np.all(np.isin(vectors[..., 1], sorted(writers)), axis=(0, 1))
        tag = (np.arange(2)[:, None] * TINY.num_kv_heads + np.arange(TINY.num_kv_heads))[:, :, None]
        wrong |= np.any(vectors[..., 3] != tag, axis=(0, 1))
    return int(wrong.sum())


def clean(call: Callable[[], Any]) -> Any:
    """Run `call`; a domain error (a miss, a checksum status) is fine and returns None, INTERNAL is not."""
    try:
        return call()
    except RpcFailedError as exc:  # INTERNAL, UNAVAILABLE, ...: a bug or a dead server
        pytest.fail(f"not a clean status: {exc}")
    except (NotFoundError, ChecksumError):
        return None


# -- two sidecars of other chunk sizes share one Redis; a third reads ------------------------


def test_sidecars_of_other_chunk_sizes_never_serve_each_others_kv(tmp_path: Path, redis_url: str) -> None:
    shared = ["--layout", "layered", "--remote-url", redis_url, "--remote-prefix", uuid.uuid4().hex]
    toks = make_tokens(N, seed=23)
    writer_8 = Sidecar(tmp_path / "w8", [*shared, "--layer-chunk-tokens", "8"]).start()
    try:
        with KVClient(writer_8.address, use_shm=False) as client:
            assert client.store(toks, positional_kv(TINY, N, writer=1), model=TINY).new_blocks == 3
    finally:
        code, err = writer_8.terminate()  # SIGTERM drains the write-behind queue
    assert code == 0, err
    reader = Sidecar(tmp_path / "reader", [*shared, "--layer-chunk-tokens", "8"]).start()
    try:
        with KVClient(reader.address, use_shm=False) as client:
            assert client.lookup(toks, model=TINY).num_tokens == N  # learns the 8-token blocks' metadata
            writer_16 = Sidecar(tmp_path / "w16", [*shared, "--layer-chunk-tokens", "16"]).start()
            try:
                with KVClient(writer_16.address, use_shm=False) as other:
                    assert other.store(toks, positional_kv(TINY, N, writer=2), model=TINY).new_blocks == 3
            finally:
                code, err = writer_16.terminate()
            assert code == 0, err
            _read_every_way(client, toks)
            stats = client.stats()
    finally:
        reader.kill()
    assert stats.get("chunk_misses") >= 1  # the 8-token records were replaced: a miss, never a mix


def _read_every_way(client: KVClient, toks: Array) -> None:
    """LoadLayers reads, a Load at budget 0.5 and full Loads: no wrong token, no INTERNAL."""
    delivered = 0

    def read_layers() -> None:
        nonlocal delivered
        with client.open_layers(toks, model=TINY) as load:
            for layer, chunks in ((0, [1, 2]), (1, [0, 3, 5]), (0, list(range(load.matched_tokens // 8)))):
                if not load.matched_tokens:
                    return
                piece = load.read_layer(
                    layer, [c for c in chunks if c < load.matched_tokens // load.chunk_tokens]
                )
                assert wrong_tokens(piece.positions, piece.kv, {1, 2}, layer=layer) == 0
                delivered += len(piece.positions)

    clean(read_layers)
    for budget in (0.5, 1.0, 1.0):
        got = clean(lambda b=budget: client.load_arrays(toks, model=TINY, budget=b))
        if got is not None:
            covered, positions, kv = got
            assert wrong_tokens(positions, kv, {1, 2}) == 0
            assert len(np.unique(positions)) == len(positions) <= covered
    covered, positions, kv = client.load_arrays(toks, model=TINY)  # settled: the 16-token blocks, whole
    assert covered == N and positions.tolist() == list(range(N))
    assert wrong_tokens(positions, kv, {2}) == 0


# -- forged records: a valid checksum and identity, another geometry ---------------------------


def _config(data_dir: Path | None, **kwargs: Any) -> StoreConfig:
    """Layout v2 (a value per layer record, each one forged on its own); packs: test_layer_pack.py."""
    return StoreConfig(
        data_dir=data_dir, block_tokens=B, chunk_tokens=8, memory_bytes=64 << 20, layout="layered",
        layer_chunk_tokens=8, layered_pack=False, **kwargs,
    )  # fmt: skip


def _forged_layer_record(meta: BlockMeta, layer: int, how: str) -> bytes:
    """Layer `layer`'s record of `meta`'s block, checksummed, with the block's identity, but with
    one thing of its geometry other than the block's metadata and the model say."""
    kv = positional_kv(TINY, N, writer=9)[layer][:, :, meta.start : meta.start + B]  # (2, heads, B, dim)
    cid = meta.chunk_id(meta.record_index(layer, 0))
    if how == "chunk_tokens":
        return encode_layer_record(cid, kv, TINY.dtype, 16)
    if how == "num_chunks":
        return encode_layer_record(cid, kv[:, :, : B // 2], TINY.dtype, 8)
    if how == "layer":
        return encode_layer_record(meta.chunk_id(meta.record_index(1 - layer, 0)), kv, TINY.dtype, 8)
    if how == "dtype":
        return encode_layer_record(cid, kv.astype(np.float32), "float32", 8)
    if how == "kv_heads":
        return encode_layer_record(cid, np.concatenate([kv, kv[:, :1]], axis=1), TINY.dtype, 8)
    assert how == "head_dim"
    return encode_layer_record(cid, np.concatenate([kv, kv], axis=3), TINY.dtype, 8)


GEOMETRIES = ["chunk_tokens", "num_chunks", "layer", "dtype", "kv_heads", "head_dim"]


@pytest.fixture
def remote(redis_url: str) -> Iterator[tuple[str, Any]]:
    import redis

    prefix = uuid.uuid4().hex
    client = redis.Redis.from_url(redis_url)
    yield prefix, client
    client.close()


def _redis_key(prefix: str, meta: BlockMeta, index: int) -> bytes:
    return f"{prefix}:{{{meta.key.hex()}}}:c:{meta.layout_version}:{index}".encode()  # docs/keys.md


@pytest.mark.parametrize("how", GEOMETRIES)
@pytest.mark.parametrize("read", ["load", "layers"])
def test_forged_remote_record_is_a_counted_miss_and_the_block_is_dropped(
    tmp_path: Path, redis_url: str, remote: tuple[str, Any], how: str, read: str
) -> None:
    prefix, redis_client = remote
    toks = make_tokens(N, seed=31)
    with TieredStore(_config(tmp_path / "w", remote_url=redis_url, remote_prefix=prefix)) as writer:
        writer.store(toks, positional_kv(TINY, N, writer=1), model=TINY)
        second = writer.tree.get(_keys(writer, toks)[1])
        assert second is not None
        meta: BlockMeta = second.payload
    assert meta.layout_version == layered_layout_version(8, packed=False)
    key = _redis_key(prefix, meta, meta.record_index(1, 0))
    assert redis_client.exists(key)
    redis_client.set(key, _forged_layer_record(meta, 1, how))
    with TieredStore(_config(tmp_path / "r", remote_url=redis_url, remote_prefix=prefix)) as reader:
        if read == "load":
            covered, positions, kv = reader.load_arrays(toks, model=TINY)
            assert covered == B and positions.tolist() == list(range(B))  # block 0 only, then a miss
            assert wrong_tokens(positions, kv, {1}) == 0
        else:
            with (
                reader.open_layers(toks, model=TINY) as load,
                pytest.raises(NotFoundError, match=meta.key.hex()),
            ):
                load.read_layer(1, [B // 8 + 1])  # block 1's chunk 1: its header, as a byte range
        stats = reader.stats()
        assert stats.get("geometry_mismatches") == 1 and stats.get("remote.corrupt") == 1
        assert reader.tree.get(meta.key) is None  # dropped from the tree and memory
        assert reader.memory.chunks_held(meta.key) == 0
        assert not redis_client.exists(key)  # and from the shared tier: wrong for every reader
        assert reader.lookup(toks, model=TINY).num_tokens == B


def _keys(store: TieredStore, toks: Array) -> list[bytes]:
    return [n.key for n in store.index.match(store._root(TINY, "default"), toks, touch=False).nodes]


def _rewrite_lmdb_record(config: StoreConfig, key: bytes, data: bytes) -> None:
    import lmdb

    env = lmdb.open(str(config.lmdb_dir), max_dbs=4, map_size=1 << 30)
    with env.begin(write=True, db=env.open_db(b"chunks")) as txn:
        assert txn.get(key) is not None
        txn.put(key, data)
    env.close()


@pytest.mark.parametrize("how", GEOMETRIES)
@pytest.mark.parametrize("read", ["load", "layers", "whole-layer"])
def test_forged_local_record_is_refused_counted_and_its_block_dropped(
    tmp_path: Path, how: str, read: str
) -> None:
    config = _config(tmp_path / "data")
    toks = make_tokens(N, seed=37)
    with TieredStore(config) as store:
        store.store(toks, positional_kv(TINY, N, writer=1), model=TINY)
        metas: list[BlockMeta] = [store.tree.get(k).payload for k in _keys(store, toks)]  # type: ignore[union-attr]
    meta = metas[1]
    _rewrite_lmdb_record(
        config,
        chunk_key(meta.key, meta.layout_version, meta.record_index(1, 0)),
        _forged_layer_record(meta, 1, how),
    )
    with TieredStore(config) as store:
        lmdb_tier = store.durable[0]
        before = lmdb_tier.usage().used_bytes
        if read == "load":
            covered, positions, kv = store.load_arrays(toks, model=TINY)
            assert covered == B and wrong_tokens(positions, kv, {1}) == 0
        else:
            chunks = [B // 8 + 1] if read == "layers" else list(range(B // 8, 2 * B // 8))
            with (
                store.open_layers(toks, model=TINY) as load,
                pytest.raises(GeometryError, match=meta.key.hex()),
            ):
                load.read_layer(1, chunks)
        assert store.stats().get("geometry_mismatches") == 1
        assert store.stats().get("checksum_failures") == 0
        assert store.tree.get(meta.key) is None and store.tree.get(metas[2].key) is None
        assert not lmdb_tier.contains(meta.key) and not lmdb_tier.contains(metas[2].key)
        assert lmdb_tier.usage().used_bytes == before - meta.nbytes - metas[2].nbytes
        assert store.lookup(toks, model=TINY).num_tokens == B
    with TieredStore(config) as store:  # nothing of it comes back at a restart
        assert store.lookup(toks, model=TINY).num_tokens == B and store.orphans == 0


def test_forged_importance_chunk_positions_are_refused(tmp_path: Path) -> None:
    config = replace(_config(tmp_path / "data"), layout="importance")
    toks = make_tokens(N, seed=41)
    kv = positional_kv(TINY, N, writer=1)
    with TieredStore(config) as store:
        store.store(toks, kv, model=TINY)
        meta: BlockMeta = store.tree.get(_keys(store, toks)[2]).payload  # type: ignore[union-attr]
    offsets = meta.chunk_offsets(1)
    shifted = (offsets + 1) % B  # a valid chunk of this identity whose KV is of other positions
    forged = encode_chunk(
        meta.chunk_id(1), meta.start + shifted, kv[:, :, :, meta.start + shifted], TINY.dtype
    )
    _rewrite_lmdb_record(config, chunk_key(meta.key, meta.layout_version, 1), forged)
    with TieredStore(config) as store:
        covered, positions, out = store.load_arrays(toks, model=TINY)
        assert covered == 2 * B and wrong_tokens(positions, out, {1}) == 0
        assert store.stats().get("geometry_mismatches") == 1
        assert not store.durable[0].contains(meta.key)


def test_a_layered_chunk_size_is_part_of_every_record_key_and_identity(tmp_path: Path) -> None:
    toks = make_tokens(N, seed=43)
    metas: dict[int, BlockMeta] = {}
    for c in (8, 16):
        with TieredStore(replace(_config(tmp_path / f"c{c}"), layer_chunk_tokens=c)) as store:
            store.store(toks, positional_kv(TINY, N, writer=1), model=TINY)
            metas[c] = store.tree.get(_keys(store, toks)[0]).payload  # type: ignore[union-attr]
    assert {c: m.layout_version for c, m in metas.items()} == {8: 0x8000_0008, 16: 0x8000_0010}
    assert metas[8].key == metas[16].key  # the same block, ...
    for index in range(metas[8].num_chunks):  # ... but no record key or identity in common
        assert chunk_key(metas[8].key, metas[8].layout_version, index) != chunk_key(
            metas[16].key, metas[16].layout_version, index
        )
        assert metas[8].chunk_id(index) != metas[16].chunk_id(index)
    forged = replace(metas[16], chunk_tokens=8)  # metadata of 16-token keys that says 8-token chunks
    assert identity_error(forged) == "layout version 0x80000010 is of 16-token chunks, not 8"
    with pytest.raises(ChecksumError, match="16-token chunks, not 8"):
        BlockMeta.from_bytes(forged.to_bytes())
    assert issubclass(GeometryError, ChecksumError)  # a clean DATA_LOSS status over gRPC, never INTERNAL
