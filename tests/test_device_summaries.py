"""Key summaries scored on the model's device: their codes read packed (kvstore/load/summaries.py,
`LocalLayeredLoad.packed_summary`) and unpacked and dequantised there (engine_adapter/runner/
chunk_mass.py `device_keys`): on the CPU the same ops, held equal to the host's decoding to the bit."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine_adapter.runner.chunk_mass import device_keys
from kvstore.config import StoreConfig
from kvstore.errors import ChecksumError, InvalidInputError
from kvstore.store.tiered import TieredStore
from tests.conftest import TINY, corrupt_chunk, make_kv, make_tokens

B, C, N = 32, 8, 4 * 32


def _config(tmp_path: Path, **kwargs: object) -> StoreConfig:
    return StoreConfig(data_dir=tmp_path / "data", block_tokens=B, layer_chunk_tokens=C, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("codec", ["raw", "shuffle-zstd"])
def test_device_keys_equal_the_hosts_decoding_layer_by_layer(tmp_path: Path, codec: str) -> None:
    toks = make_tokens(N)
    with TieredStore(_config(tmp_path, codec=codec)) as store:
        store.store(toks, make_kv(TINY, N), model=TINY)
    with (
        TieredStore(_config(tmp_path, codec=codec)) as store,  # summaries read from disk this time
        store.open_layers(toks, model=TINY) as packed_load,
        store.open_layers(toks, model=TINY) as host_load,
    ):
        for layer in range(TINY.num_layers):  # in order: the read-ahead thread runs ahead
            packed = packed_load.packed_summary(layer)
            assert packed.codes.shape[0] == N // B and packed.codes.dtype == np.uint8
            got = device_keys(packed, torch.device("cpu"))
            np.testing.assert_array_equal(got.numpy(), host_load.key_summary(layer))
        assert packed_load.bytes_read == host_load.bytes_read  # the same records, counted once each


def test_a_corrupt_summary_is_a_checksum_error_on_the_packed_path_too(tmp_path: Path) -> None:
    toks = make_tokens(N)
    config = _config(tmp_path)
    with TieredStore(config) as store:
        store.store(toks, make_kv(TINY, N), model=TINY)
        metas = sorted(store.listed_blocks(), key=lambda m: m.start)
    corrupt_chunk(config, metas[2].key, 0)  # layer 0's summary of the third block
    with TieredStore(config) as store, store.open_layers(toks, model=TINY) as load:
        with pytest.raises(ChecksumError, match=metas[2].key.hex()):
            load.packed_summary(0)
        assert store.lookup(toks, model=TINY).num_tokens == 2 * B  # it and the blocks after it are gone


def test_codes_that_do_not_fill_bytes_are_left_to_the_host() -> None:
    class Packed:
        codes = np.zeros((1, 8), np.uint8)
        bits, shape, group_tokens = 3, (1, 8, 1), 8
        low = step = np.zeros((1, 1, 1, 1), np.float16)

    with pytest.raises(ValueError, match="3-bit codes"):
        device_keys(Packed(), torch.device("cpu"))


def test_read_layer_fills_a_buffer_it_is_given_and_refuses_another_shape(tmp_path: Path) -> None:
    toks = make_tokens(N)
    with TieredStore(_config(tmp_path)) as store:
        store.store(toks, make_kv(TINY, N), model=TINY)
        with store.open_layers(toks, model=TINY) as load:
            chunks = [0, 3, 5, 9]
            expected = load.read_layer(1, chunks)
            out = np.full((2, TINY.num_kv_heads, len(chunks) * C, TINY.head_dim), 7, load.kv_dtype)
            got = load.read_layer(1, chunks, out=out)
            assert got.kv is out and np.array_equal(out, expected.kv)
            np.testing.assert_array_equal(got.positions, expected.positions)
            with pytest.raises(InvalidInputError, match="out must be float16"):
                load.read_layer(1, chunks, out=out[:, :, :-1])


def test_a_pinned_copy_needs_no_staging_and_the_cache_gets_what_was_read() -> None:
    from engine_adapter.runner.device import read_into_cache
    from kvstore.load.device import DeviceCopier

    copier = DeviceCopier("cpu")
    source = torch.arange(24, dtype=torch.float16).reshape(2, 3, 4)
    target = torch.zeros(2, 3, 4, dtype=torch.float32)
    assert copier.upload_pinned(source, target) is None and torch.equal(target, source.float())
    assert copier.pool.allocations == 0  # nothing staged

    layer = SimpleNamespace(keys=torch.zeros(1, 2, 4, 8), values=torch.zeros(1, 2, 4, 8))  # a cache layer
    # chunk-major, as `LocalLayeredLoad.read_chunks` delivers: 2 chunks of 2 tokens, (n, 2, heads, c, dim)
    kv = np.random.default_rng(0).standard_normal((2, 2, 2, 2, 8)).astype(np.float16)
    in_order = kv.transpose(1, 2, 0, 3, 4).reshape(2, 2, 4, 8)  # (2, heads, tokens, dim), prompt order

    class Part:
        def __init__(self) -> None:
            self.kv = kv

    part = read_into_cache(layer, lambda out: Part(), kv.shape, kv.dtype)
    assert part.kv is kv
    np.testing.assert_array_equal(layer.keys[0].numpy(), in_order[0].astype(np.float32))
    np.testing.assert_array_equal(layer.values[0].numpy(), in_order[1].astype(np.float32))
