"""How a query-aware load reads a cold layered store (issue #27, item 5): a block's layer-record
header and its chosen chunks in one ranged read, and summaries promoted to memory only when the
load closes (off the prefill's path). Real LMDB under tmp_path; raw and zstd records.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvstore.format.layer_record import header_bytes
from kvstore.store.tiered import TieredStore
from tests.conftest import TINY
from tests.test_layered_store import B, C, _config, _metas, _stored


@pytest.mark.parametrize("codec", ["raw", "shuffle-zstd"])
def test_header_and_chunks_of_a_block_come_in_one_read(tmp_path: Path, codec: str) -> None:
    with TieredStore(_config(tmp_path, codec=codec)) as store:
        toks, kv, _ = _stored(store)
    with TieredStore(_config(tmp_path, codec=codec)) as store:  # restarted: nothing in memory
        before = store.stats().counters.get("chunk_hits.lmdb", 0)
        with store.open_layers(toks, model=TINY) as load:
            # chunks 1, 2 (adjacent) and 3 of block 0, and chunk 5 of block 1 (local 1)
            got = load.read_layer(1, [1, 2, 3, 5])
            np.testing.assert_array_equal(got.positions, np.r_[8:32, 40:48])
            expected = np.concatenate([kv[1][:, :, 8:32], kv[1][:, :, 40:48]], axis=2)
            np.testing.assert_array_equal(got.kv, expected)
            reads = store.stats().counters["chunk_hits.lmdb"] - before
            # raw: one read per block, the header with its chunks. zstd chunks are not where an
            # uncompressed record would put them: block 0's guess is wasted (and counted), then the
            # load reads by the header (block 1: the header, then its chunks' ranges from that tier)
            assert reads == 2
            chunk_bytes = 2 * TINY.num_kv_heads * C * TINY.head_dim * 2
            if codec == "raw":
                assert load.bytes_read == 2 * header_bytes(B // C) + 4 * chunk_bytes
            read = load.bytes_read
            again = load.read_layer(1, [0])  # block 0's header is kept: only the chunk's range
            np.testing.assert_array_equal(again.kv, kv[1][:, :, 0:8])
            if codec == "raw":
                assert load.bytes_read == read + chunk_bytes
            else:
                assert header_bytes(B // C) < read < 2 * header_bytes(B // C) + 8 * chunk_bytes


def test_summaries_are_promoted_when_the_load_closes(tmp_path: Path) -> None:
    with TieredStore(_config(tmp_path)) as store:
        toks, _, _ = _stored(store)
    with TieredStore(_config(tmp_path)) as store:
        metas = _metas(store, toks)
        load = store.open_layers(toks, model=TINY)
        load.key_summary(0)
        load.key_summary(1)
        assert not any(store.memory.has_chunk(m.key, layer) for m in metas for layer in range(2))
        load.close()
        assert all(store.memory.has_chunk(m.key, layer) for m in metas for layer in range(2))
        with store.open_layers(toks, model=TINY) as again:  # now from memory
            again.key_summary(0)
        assert store.stats().counters["summary_hits.memory"] >= len(metas)
