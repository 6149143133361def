"""A full load straight to the device from where the store holds it (engine_adapter/runner/upload.py):
on the CPU the same feeder runs with CPU tensors, so its copies are counted and its order checked.

Each byte crosses host memory once: a block memory holds is copied from the tier's own buffer (no
staging copy); a block read from disk is copied once, into memory, and from there.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine_adapter.runner.device import KVTransfer
from engine_adapter.runner.upload import layers_per_copy
from kvstore.config import StoreConfig
from kvstore.load.stream import LocalLoadStream
from kvstore.model import ModelSpec
from kvstore.store.tiered import TieredStore

SPEC = ModelSpec("upload-test", num_layers=6, num_kv_heads=2, head_dim=8)
BLOCK = 32


def _store(tmp_path: Path, **overrides: object) -> TieredStore:
    config = StoreConfig(
        data_dir=tmp_path / "kv",
        block_tokens=BLOCK,
        host_arena=True,
        **overrides,  # type: ignore[arg-type]
    )
    return TieredStore(config)


def _kv(tokens: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(SPEC.kv_shape(tokens)).astype(np.float16)


def _upload(store: TieredStore, tokens: np.ndarray, dtype: torch.dtype = torch.float32) -> tuple:
    stream = store.load(tokens, model=SPEC)
    assert isinstance(stream, LocalLoadStream)
    views = stream.pack_views()
    assert views is not None
    views = list(views)
    transfer = KVTransfer(torch.device("cpu"), staging=True)
    upload = transfer.upload_views(views, SPEC.num_layers, dtype, owner=stream)
    upload.wait_all()
    upload.close()
    return views, upload, stream


def test_a_memory_hit_is_copied_from_the_tiers_own_bytes_once(tmp_path: Path) -> None:
    tokens = np.arange(4 * BLOCK)
    kv = _kv(len(tokens))
    with _store(tmp_path) as store:
        store.store(tokens, kv, model=SPEC)
        views, upload, stream = _upload(store, tokens)
        arena = store.memory.arena
        assert arena is not None
        assert all(v.tier == "memory" for v in views)
        assert all(arena.is_arena_memory(np.frombuffer(v.data, np.uint8)) for v in views)
        groups = -(-SPEC.num_layers // layers_per_copy(views[0], SPEC.num_layers))
        counts = upload.counts
        assert counts.staged_bytes == 0  # no host copy: the device copy reads the tier's bytes
        assert counts.device_copies == len(views) * groups  # one per block and layer group
        assert counts.rearranges == SPEC.num_layers  # every block of a layer in one strided copy
        assert counts.order == list(range(groups))  # events made layer group by layer group
        for layer, (keys, values) in enumerate(upload.pairs):
            np.testing.assert_array_equal(keys[0].numpy(), kv[layer, 0].astype(np.float32))
            np.testing.assert_array_equal(values[0].numpy(), kv[layer, 1].astype(np.float32))
        assert stream.num_tokens == len(tokens) and stream.delivered_tokens == len(tokens)
        assert stream.bytes_read == sum(v.nbytes for v in views)


def test_a_disk_hit_is_copied_once_into_memory_then_viewed_there(tmp_path: Path) -> None:
    tokens = np.arange(3 * BLOCK)
    kv = _kv(len(tokens), seed=1)
    with _store(tmp_path) as store:
        store.store(tokens, kv, model=SPEC)
    with _store(tmp_path) as store:  # a new process: memory is empty, the disk holds the blocks
        before = store.memory.usage().used_bytes
        views, upload, _ = _upload(store, tokens, torch.float16)
        arena = store.memory.arena
        assert arena is not None and all(v.tier == "lmdb" for v in views)  # read from disk...
        assert all(
            arena.is_arena_memory(np.frombuffer(v.data, np.uint8)) for v in views
        )  # ...viewed in memory
        assert store.memory.usage().used_bytes - before == sum(len(v.data) for v in views)
        assert upload.counts.staged_bytes == 0
        got = np.stack([torch.stack([k[0], v[0]]).numpy() for k, v in upload.pairs])
        np.testing.assert_array_equal(got, kv)


def test_partial_budgets_and_other_layouts_have_no_views(tmp_path: Path) -> None:
    tokens = np.arange(2 * BLOCK)
    with _store(tmp_path) as store:
        store.store(tokens, _kv(len(tokens)), model=SPEC)
        assert store.load(tokens, model=SPEC, budget=0.5).pack_views() is None
        stream = store.load(tokens, model=SPEC)
        next(iter(stream))  # a stream already read from cannot turn into views
        assert stream.pack_views() is None
    with _store(tmp_path / "importance", layout="importance") as store:
        store.store(tokens, _kv(len(tokens)), model=SPEC)
        assert store.load(tokens, model=SPEC).pack_views() is None


def test_a_corrupt_block_ends_the_views_and_the_prefix_there(tmp_path: Path) -> None:
    tokens = np.arange(3 * BLOCK)
    with _store(tmp_path) as store:
        store.store(tokens, _kv(len(tokens)), model=SPEC)
    lost = []
    with _store(tmp_path) as store:
        metas = store.listed_blocks()
        second = sorted(metas, key=lambda m: m.start)[1]
        disk = store.tiers.local_durable[0]
        disk.delete_block(second.key)  # the index still lists it: the load finds it missing
        stream = store.load(tokens, model=SPEC)
        views = stream.pack_views()
        assert views is not None
        lost = list(views)
        assert [v.block_index for v in lost] == [0]
        assert stream.num_tokens == BLOCK


@pytest.mark.parametrize(
    "layer_bytes, layers, expected", [(4 << 20, 32, 2), (1 << 20, 32, 4), (192 << 10, 30, 22), (64, 4, 4)]
)
def test_a_device_copy_moves_4_mib_where_layers_allow_and_at_most_16_groups(
    layer_bytes: int, layers: int, expected: int
) -> None:
    class View:
        pass

    view = View()
    view.layer_bytes = layer_bytes  # type: ignore[attr-defined]
    assert layers_per_copy(view, layers) == expected  # type: ignore[arg-type]
