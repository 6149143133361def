"""A block dropped for damage frees its disk records at once (issue #23, item 6).

Real LMDB under tmp_path with a disk budget; a byte of one stored record flipped in the
file; a load that finds it. Then the disk tier's used bytes must have dropped by the bytes of
the dropped blocks, and a Store that needs that room must succeed (before the fix it failed
RESOURCE_EXHAUSTED, "held by pinned blocks", until a restart or `fsck --repair`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import TINY, corrupt_chunk, make_kv, make_tokens

from kvstore.config import StoreConfig
from kvstore.errors import ChecksumError, InvalidInputError
from kvstore.format.block_meta import BlockMeta
from kvstore.store.tiered import TieredStore

B = 32
N = 3 * B
Array = np.ndarray[Any, Any]


def _config(data_dir: Path, layout: str, disk_bytes: int | None = None) -> StoreConfig:
    return StoreConfig(
        data_dir=data_dir, block_tokens=B, chunk_tokens=8, memory_bytes=64 << 20, layout=layout,
        layer_chunk_tokens=8, disk_bytes=disk_bytes,
    )  # fmt: skip


def _metas(store: TieredStore, toks: Array) -> list[BlockMeta]:
    return [n.payload for n in store.index.match(store._root(TINY, "default"), toks, touch=False).nodes]


def _full_disk(tmp_path: Path, layout: str) -> tuple[StoreConfig, Array, list[BlockMeta]]:
    """A store whose disk budget is exactly one 3-block prompt, holding that prompt (closed)."""
    toks, kv = make_tokens(N, seed=61), make_kv(TINY, N, seed=61)
    with TieredStore(_config(tmp_path / "probe", layout)) as probe:
        probe.store(toks, kv, model=TINY)
        assert probe.flush()  # on disk, not only acknowledged from memory
        budget = probe.durable[0].usage().used_bytes
    config = _config(tmp_path / "data", layout, disk_bytes=budget)
    with TieredStore(config) as store:
        assert store.store(toks, kv, model=TINY).new_blocks == 3
        assert store.flush()
        assert store.durable[0].usage().used_bytes == budget  # full
        metas = _metas(store, toks)
    return config, toks, metas


def _find_damage(store: TieredStore, toks: Array, layout: str, via: str) -> None:
    """Load the prompt: a miss at the damaged block (load) or a ChecksumError (layer by layer)."""
    if via == "load":
        covered, _, _ = store.load_arrays(toks, model=TINY)
        assert covered < N
        return
    with store.open_layers(toks, model=TINY) as load, pytest.raises(ChecksumError):
        for layer in range(TINY.num_layers):
            load.read_layer(layer, list(range(N // 8)))


def _damage(config: StoreConfig, meta: BlockMeta, layout: str) -> None:
    index = 2  # a chunk of an importance-layout block
    if layout == "layered":  # layer 1's record, or the pack holding it (the middle byte: in layer 1)
        index = meta.pack_index if meta.is_packed else meta.record_index(1, 0)
    corrupt_chunk(config, meta.key, index)


CASES = [("importance", "load"), ("layered", "load"), ("layered", "layers")]


@pytest.mark.parametrize(("layout", "via"), CASES)
def test_a_corrupt_last_block_frees_exactly_its_bytes(tmp_path: Path, layout: str, via: str) -> None:
    config, toks, metas = _full_disk(tmp_path, layout)
    _damage(config, metas[2], layout)
    with TieredStore(config) as store:
        disk = store.durable[0]
        before = disk.usage()
        _find_damage(store, toks, layout, via)
        after = disk.usage()
        assert store.stats().get("checksum_failures") == 1
        assert before.used_bytes - after.used_bytes == metas[2].nbytes  # at once, not at a restart
        assert (after.num_blocks, after.num_chunks) == (2, before.num_chunks - metas[2].num_chunks)
        assert not disk.contains(metas[2].key) and disk.contains(metas[1].key)
        assert store.lookup(toks, model=TINY).num_tokens == 2 * B
        other, kv = make_tokens(B, seed=62), make_kv(TINY, B, seed=62)  # needs the freed room exactly
        assert store.store(other, kv, model=TINY).new_blocks == 1
        _, positions, out = store.load_arrays(toks[: 2 * B], model=TINY)  # the rest is untouched
        assert positions.tolist() == list(range(2 * B))
        assert out.tobytes() == make_kv(TINY, N, seed=61)[:, :, :, : 2 * B].tobytes()
    with TieredStore(config) as store:  # and at a restart: no orphan, nothing damaged
        assert store.orphans == 0 and store.lookup(toks, model=TINY).num_tokens == 2 * B
        assert store.lookup(other, model=TINY).num_tokens == B


@pytest.mark.parametrize(("layout", "via"), CASES)
def test_a_corrupt_first_block_frees_its_subtree_and_stores_succeed(
    tmp_path: Path, layout: str, via: str
) -> None:
    config, toks, metas = _full_disk(tmp_path, layout)
    _damage(config, metas[0], layout)
    with TieredStore(config) as store:
        disk = store.durable[0]
        _find_damage(store, toks, layout, via)
        # The block and the two below it (unreachable without it) leave the tree and the disk.
        assert disk.usage().used_bytes == 0 and disk.usage().num_blocks == 0
        assert store.tree.num_blocks == 0 and store.stats().get("blocks_dropped") == 3
        fresh, kv = make_tokens(N, seed=63), make_kv(TINY, N, seed=63)  # needs the whole budget
        assert store.store(fresh, kv, model=TINY).new_blocks == 3
        _, positions, out = store.load_arrays(fresh, model=TINY)
        assert positions.tolist() == list(range(N)) and out.tobytes() == kv.tobytes()
        again = make_kv(TINY, N, seed=61)  # and the damaged prompt can be stored again, in turn
        assert store.store(toks, again, model=TINY).new_blocks == 3
        _, _, out = store.load_arrays(toks, model=TINY)
        assert out.tobytes() == again.tobytes()


def test_bad_input_is_named_and_leaves_stored_data_untouched(tmp_path: Path) -> None:
    config, toks, _ = _full_disk(tmp_path, "layered")
    with TieredStore(config) as store:
        usage = store.durable[0].usage()
        with pytest.raises(InvalidInputError, match="shape"):
            store.store(make_tokens(N, seed=64), make_kv(TINY, N - 1, seed=64), model=TINY)
        with pytest.raises(InvalidInputError, match="namespace"):
            store.load(toks, model=TINY, namespace="")
        assert store.durable[0].usage() == usage
        _, positions, out = store.load_arrays(toks, model=TINY)
        assert positions.tolist() == list(range(N))
        assert out.tobytes() == make_kv(TINY, N, seed=61).tobytes()
