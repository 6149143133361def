"""A layered full load copies every byte once: `gather` lends its array to the reader (a
`Destination`), a layered block joins its layers there, and `place_chunks` skips what is in place.

Real LMDB under tmp_path; the kept headers of a cold load; the batched key summaries.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.config import StoreConfig
from kvstore.errors import InvalidInputError
from kvstore.format.chunk import ChunkId
from kvstore.format.key_summary import (
    FINITE_LIMIT,
    SummaryGeometry,
    decode_summary,
    encode_summaries,
    encode_summary,
)
from kvstore.load.assemble import Destination, place_chunks
from kvstore.load.stream import BlockStream
from kvstore.store.tiered import TieredStore
from kvstore.values import LoadedChunk
from tests.conftest import TINY, make_kv, make_tokens

B, C = 32, 8  # block tokens; tokens per per-layer chunk
N = 3 * B
Array = np.ndarray[Any, Any]


def _config(tmp_path: Path, layout: str = "layered") -> StoreConfig:
    return StoreConfig(
        data_dir=tmp_path / "data", block_tokens=B, chunk_tokens=16, memory_bytes=64 << 20,
        layout=layout, layer_chunk_tokens=C,
    )  # fmt: skip


@pytest.fixture
def stored(tmp_path: Path) -> Iterator[tuple[TieredStore, Array, Array]]:
    """A layered prefix of 3 blocks, written, then read by a restarted store (memory empty)."""
    toks, kv = make_tokens(N, 0), make_kv(TINY, N, 0)
    scores = np.random.default_rng(7).random(N).astype(np.float32)
    with TieredStore(_config(tmp_path)) as store:
        store.store(toks, kv, model=TINY, scores=scores)
    with TieredStore(_config(tmp_path)) as store:
        yield store, toks, kv


def _in_prompt_order(positions: Array, kv: Array) -> Array:
    return np.take(kv, np.argsort(positions), axis=3)


def test_a_lent_destination_receives_every_layered_chunk(stored: tuple[TieredStore, Array, Array]) -> None:
    store, toks, kv = stored
    for _ in range(2):  # cold (from LMDB, promoted), then warm (from memory)
        stream = store.load(toks, model=TINY)
        blocks = stream._blocks
        assert isinstance(blocks, BlockStream)
        destination = Destination(np.empty(TINY.kv_shape(N), TINY.np_dtype))
        blocks.destination = destination
        chunks = list(stream)
        # a packed block's consecutive chunks come as one chunk per run (a full block: one)
        assert len(chunks) == N // B and destination.next_slot == N
        assert [c.positions.tolist() for c in chunks] == [list(range(b * B, (b + 1) * B)) for b in range(3)]
        assert all(np.shares_memory(c.kv, destination.out) for c in chunks)
        destination.out.flags.writeable = False  # place_chunks must write nothing: all is in place
        placed = place_chunks(chunks, destination.out, at_positions=False)
        assert placed.num_tokens == N
        np.testing.assert_array_equal(_in_prompt_order(placed.positions, destination.out), kv)


@pytest.mark.parametrize("budget", [1.0, 0.5])
def test_gather_is_bit_exact_cold_and_warm(stored: tuple[TieredStore, Array, Array], budget: float) -> None:
    store, toks, kv = stored
    for _ in range(2):
        num_tokens, positions, out = store.load_arrays(toks, model=TINY, budget=budget)
        assert num_tokens == N and out.flags.c_contiguous
        np.testing.assert_array_equal(out, kv[:, :, :, positions])
        assert len(positions) == N if budget == 1.0 else len(positions) < N


def test_chunks_read_without_a_destination_are_their_own(stored: tuple[TieredStore, Array, Array]) -> None:
    store, toks, kv = stored
    chunks = list(store.load(toks, model=TINY))
    out = np.empty(TINY.kv_shape(N), TINY.np_dtype)
    assert not any(np.shares_memory(c.kv, out) for c in chunks)
    placed = place_chunks(chunks, out, at_positions=False)
    np.testing.assert_array_equal(_in_prompt_order(placed.positions, out), kv)


def test_a_chunk_lent_at_another_slot_is_copied() -> None:
    out = np.zeros((2, 2, 1, 8, 3), np.float16)
    out[:, :, :, 4:8] = 1.0
    moved = LoadedChunk(0, 0, np.arange(4), out[:, :, :, 4:8], "memory", 0)  # at slots 4..8, goes to 0..4
    place_chunks([moved], out, at_positions=False)
    assert np.all(out[:, :, :, :4] == 1.0)


def test_a_cold_load_keeps_the_headers_it_verified(
    stored: tuple[TieredStore, Array, Array], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once per block, as its pack's list (issue 47: no index work per layer on the load's path),
    and a layer record memory holds is then read without parsing its header again."""
    import kvstore.load.fetch as fetch

    store, toks, _ = stored
    records = store.reader.layer_records
    assert not records._headers and not records._packs
    store.load_arrays(toks, model=TINY)
    assert not records._headers  # nothing kept layer by layer ...
    assert len(records._packs) == 3  # ... every block's headers kept at once, with its pack
    parsed: list[int] = []
    monkeypatch.setattr(fetch, "parse_header", lambda *a: parsed.append(1))
    for node in store.tree.nodes():
        meta = node.payload
        held = fetch.Fetched(memoryview(b""), "memory", True)
        for layer in range(TINY.num_layers):
            geometry = fetch.layer_geometry(meta, layer, TINY)
            header = records.known_header(meta, meta.num_layers + layer, held, geometry)
            assert header is records._packs[(meta.key, meta.layout_version)][layer]
    assert not parsed


@pytest.mark.parametrize("bits", [1, 2, 3, 8])
def test_summaries_of_a_block_are_the_bytes_of_one_layer_at_a_time(bits: int) -> None:
    keys = make_kv(TINY, B, 3)[:, 0]  # (layers, kv heads, tokens, head dim)
    ids = [ChunkId(b"f" * 16, b"n" * 16, b"k" * 16, 1, layer) for layer in range(len(keys))]
    assert encode_summaries(ids, keys, bits) == [
        encode_summary(i, k, bits) for i, k in zip(ids, keys, strict=True)
    ]
    odd = (
        np.random.default_rng(bits).standard_normal((2, 1, 7, 5)).astype(np.float16)
    )  # 35 codes: no whole bytes
    assert encode_summaries(ids[:2], odd, bits) == [encode_summary(ids[i], odd[i], bits) for i in range(2)]


def test_summaries_refuse_keys_of_another_shape() -> None:
    ids = [ChunkId(b"f" * 16, b"n" * 16, b"k" * 16, 1, 0)]
    with pytest.raises(InvalidInputError, match="1 layers"):
        encode_summaries(ids, np.zeros((2, 1, 4, 4), np.float16))
    with pytest.raises(InvalidInputError, match="bits"):
        encode_summaries(ids, np.full((1, 1, 4, 4), np.nan, np.float16), bits=9)


def test_non_finite_keys_are_summarised_as_finite_ones() -> None:
    """A page pool's unused slots may hold anything: the summary takes them (NaN as 0, inf as
    FINITE_LIMIT), so a layered store keeps any KV an engine hands over."""
    ids = [ChunkId(b"f" * 16, b"n" * 16, b"k" * 16, 1, 0)]
    keys = np.random.default_rng(3).standard_normal((1, 2, 8, 4)).astype(np.float16)
    odd = keys.copy()
    odd[0, 0, 1, 2], odd[0, 1, 3, 0], odd[0, 1, 5, 1] = np.nan, np.inf, -np.inf
    tidy = keys.copy()
    tidy[0, 0, 1, 2], tidy[0, 1, 3, 0], tidy[0, 1, 5, 1] = 0.0, FINITE_LIMIT, -FINITE_LIMIT
    assert encode_summaries(ids, odd) == encode_summaries(ids, tidy) == [encode_summary(ids[0], odd[0])]
    assert encode_summaries(ids, odd) != encode_summaries(ids, keys)
    for bits in (1, 2, 8):  # every step and offset finite, so every decoded key is
        (record,) = encode_summaries(ids, np.full((1, 1, 4, 4), np.inf, np.float16), bits)
        assert np.isfinite(decode_summary(record, ids[0], SummaryGeometry(4, 1, 4)).dequantized()).all()


def test_a_layered_store_keeps_non_finite_kv_bit_exact(tmp_path: Path) -> None:
    toks, kv = make_tokens(N, 4), make_kv(TINY, N, 4)
    kv[0, 0, 0, 3, 1], kv[1, 0, 0, 40, 0], kv[1, 1, 0, 7, 2] = np.nan, np.inf, -np.inf  # keys and a value
    with TieredStore(_config(tmp_path)) as store:
        store.store(toks, kv, model=TINY)
    with TieredStore(_config(tmp_path)) as store:  # from disk
        out = np.empty(TINY.kv_shape(N), TINY.np_dtype)
        assert place_chunks(store.load(toks, model=TINY), out, at_positions=True).num_tokens == N
        assert out.tobytes() == kv.tobytes()  # NaN compares unequal: the bytes are the test
