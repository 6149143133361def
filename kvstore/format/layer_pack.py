"""Layer packs (layered layout v3): every layer record of one block in one stored value.

Version 2 of the layered layout stored each layer record as its own value: 30 values per
block for SmolLM2, 240 per 2,048-token prefix, where the importance layout reads 16 per
block. A full load paid for every one of them (a B-tree lookup and a Python round per
value; docs/importance.md, "Layered layout"). A pack holds the block's layer records
(kvstore/format/layer_record.py, unchanged, each still carrying its own identity, chunk
table and checksums) back to back behind a table of where each one starts. A full load
reads one value per block; a partial load reads the table once per block and then only
the byte ranges of the chunks it chose, shifted by the layer's offset. Layout
(little-endian)::

    header    struct _HEADER: magic "KVSP", version, the identity of the pack (fingerprint,
              namespace digest, block key, layout version, record index: a `ChunkId`),
              number of layers, xxh3-64 of the records (everything after the checksum below)
    table     per layer: offset u32 (from the pack's start), length u32
    checksum  u64 xxh3-64 over header and table
    records   the layer records, layer 0 first

The table's size depends only on the number of layers (`table_bytes`), so a reader that
knows the block's layer count reads it with one range request. A table is never trusted
about the layer count; the layer records inside are verified as ever (their identity names
their layer, so a record moved to another layer's slot is refused). A pack read whole is
verified by the one checksum of its records (`split_pack`) where a record's chunks each carry
their own (7,920 checksums a 2,048-token prefix of SmolLM2, one call each); a ranged read
verifies its chunks' own.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import xxhash

from kvstore.errors import ChecksumError, InvalidInputError
from kvstore.format.chunk import ChunkId, GeometryError, verify_header
from kvstore.format.layer_record import Array, check_layer_kv, header_bytes, write_headers

MAGIC = b"KVSP"
FORMAT_VERSION = 1
# magic, version, fingerprint, namespace digest, block key, layout version, record index, layers,
# xxh3-64 of the records
_HEADER = struct.Struct("<4sH16s16s16sIIHQ")
_ENTRY = struct.Struct("<II")
_CHECKSUM = struct.Struct("<Q")


class PackTable(NamedTuple):
    """A verified pack table: where each layer record lies in the pack."""

    offsets: list[int]  # per layer, from the pack's start
    lengths: list[int]  # per layer, bytes of its record
    records_checksum: int  # xxh3-64 of every record's bytes, from offsets[0] to the end

    def span(self, layer: int) -> tuple[int, int]:
        """[start, end) of layer `layer`'s record in the pack."""
        return self.offsets[layer], self.offsets[layer] + self.lengths[layer]

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole pack."""
        return self.offsets[-1] + self.lengths[-1]


def table_bytes(num_layers: int) -> int:
    """Bytes of a pack's header, table and checksum for `num_layers` layers."""
    return _HEADER.size + num_layers * _ENTRY.size + _CHECKSUM.size


def encode_pack(pack_id: ChunkId, records: Sequence[bytes | memoryview]) -> bytes:
    """One pack of `records` (a block's layer records, layer 0 first) under `pack_id`."""
    return encode_pack_parts(pack_id, [[record] for record in records])


def encode_pack_parts(pack_id: ChunkId, records: Sequence[Sequence[bytes | memoryview]]) -> bytes:
    """`encode_pack` of records given in parts (`layer_record_parts`: a header, then each chunk's
    bytes): the pack is then the one copy of their bytes."""
    lengths = [sum(memoryview(p).nbytes for p in parts) for parts in records]
    starts = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)[:-1])) + table_bytes(len(records))
    hasher = xxhash.xxh3_64()
    for parts in records:
        for part in parts:
            hasher.update(part)
    head = _HEADER.pack(
        MAGIC, FORMAT_VERSION, pack_id.fingerprint, pack_id.namespace, pack_id.block_key,
        pack_id.layout_version, pack_id.chunk_index, len(records), hasher.intdigest(),
    )  # fmt: skip
    body = head + b"".join(_ENTRY.pack(int(s), n) for s, n in zip(starts, lengths, strict=True))
    return b"".join(
        (body, _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body)), *(p for parts in records for p in parts))
    )


def encode_raw_pack(
    pack_id: ChunkId, record_ids: Sequence[ChunkId], kv: Array, dtype: str, chunk_tokens: int
) -> memoryview:
    """The pack of raw layer records of `kv` (layers, 2, kv_heads, tokens, head_dim), layer i under
    `record_ids[i]`: byte for byte `encode_pack_parts(pack_id, [layer_record_parts(record_ids[i],
    kv[i], dtype, chunk_tokens), ...])`, as a read-only view of a buffer of its own (what the
    tiers take: the memory tier keeps a read-only buffer without copying it).

    Why not those parts: a store encodes every block so (5.9 MB each 256 tokens of SmolLM2), and
    they cost a chunk-major copy per layer, a second one where they are joined, and Python per
    chunk. Here the chunk-major transpose, written where the bytes end up, is the one copy of the
    KV (`_copy_chunks`); checksums are of views of that buffer; every layer's header and chunk
    table are written at once (kvstore/format/layer_record.py `write_headers`).

    Raises:
        InvalidInputError: as `layer_record_parts`, or not one layer of `kv` per record id.
    """
    if kv.ndim != 5 or not 0 < len(record_ids) == kv.shape[0]:
        raise InvalidInputError(f"pack kv must be (layers, 2, heads, tokens, dim), layers {len(record_ids)}")
    check_layer_kv(kv[0], chunk_tokens)
    layers, _, heads, tokens, dim = kv.shape
    n, head = tokens // chunk_tokens, table_bytes(layers)
    record = header_bytes(n) + kv.nbytes // layers
    out = np.empty(head + layers * record, np.uint8)
    sums = _copy_chunks(out, head + header_bytes(n), record, kv, chunk_tokens)
    write_headers(out[head:].reshape(layers, record), record_ids, dtype, (heads, chunk_tokens, dim), sums)
    top = _HEADER.pack(
        MAGIC, FORMAT_VERSION, pack_id.fingerprint, pack_id.namespace, pack_id.block_key,
        pack_id.layout_version, pack_id.chunk_index, layers, xxhash.xxh3_64_intdigest(out.data[head:]),
    )  # fmt: skip
    body = top + struct.pack(
        f"<{2 * layers}I", *(x for i in range(layers) for x in (head + i * record, record))
    )
    out[:head] = np.frombuffer(body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body)), np.uint8)
    out.flags.writeable = False
    return out.data


def _copy_chunks(out: Array, first: int, record: int, kv: Array, chunk_tokens: int) -> Array:
    """Copy `kv` (layers, 2, heads, tokens, dim) chunk-major into the records in `out` (layer 0's
    first chunk at `first`, a record each `record` bytes): chunk c of a layer is its (2, heads,
    chunk_tokens, dim) from token c * chunk_tokens. Returns (layers, chunks) xxh3-64 of the chunks."""
    layers, _, heads, tokens, dim = kv.shape
    n, item = tokens // chunk_tokens, kv.dtype.itemsize
    run = chunk_tokens * dim * item  # one head's K or V in a chunk
    chunk = 2 * heads * run
    void = np.dtype((np.void, item))  # any source strides, and no alignment: records start anywhere
    dst: Array = np.ndarray(
        (layers, n, 2, heads, chunk_tokens, dim), void, out, first,
        (record, chunk, heads * run, run, dim * item, item),
    )  # fmt: skip
    np.copyto(dst, kv.view(void).reshape(layers, 2, heads, n, chunk_tokens, dim).transpose(0, 3, 1, 2, 4, 5))
    view, digest = out.data, xxhash.xxh3_64_intdigest
    starts = (first + np.arange(layers)[:, None] * record + np.arange(n) * chunk).ravel().tolist()
    return np.array([digest(view[a : a + chunk]) for a in starts], np.uint64).reshape(layers, n)


def parse_table(data: bytes | memoryview, expect: ChunkId, num_layers: int) -> PackTable:
    """Verify and parse the table at the start of `data` (the table's range or the whole pack).

    Raises:
        ChecksumError: not a pack, truncated, a checksum mismatch, another identity, or a
            table whose records are not adjacent after it.
        GeometryError: another number of layers than `num_layers` (the block's metadata).
    """
    view = memoryview(data)
    if len(view) < _HEADER.size or bytes(view[:4]) != MAGIC:
        raise ChecksumError(f"not a kvsieve layer pack (starts {bytes(view[:4])!r}, {len(view)} bytes)")
    _magic, version, fp, ns, key, layout, index, layers, records_checksum = _HEADER.unpack_from(view)
    size = table_bytes(layers)
    verify_header(view, size, version, FORMAT_VERSION, "layer pack table")
    found = ChunkId(fp, ns, key, layout, index)
    if found != expect:
        raise ChecksumError(f"layer pack identity mismatch: expected {expect}, found {found}")
    if layers != num_layers:
        raise GeometryError(f"layer pack holds {layers} layers; the block has {num_layers}")
    entries = struct.unpack_from("<" + "II" * layers, view, _HEADER.size)
    offsets, lengths = list(entries[0::2]), list(entries[1::2])
    adjacent = offsets == list(itertools.accumulate(lengths[:-1], initial=size))  # each after the last
    if layers == 0 or not adjacent:
        raise ChecksumError("layer pack table does not describe adjacent records after it")
    return PackTable(offsets, lengths, records_checksum)


def split_pack(data: bytes | memoryview, table: PackTable) -> list[memoryview]:
    """The layer records of a whole pack, as views of `data` (nothing copied), where its verified
    `table` (`parse_table`) says they lie, all their bytes verified by the table's checksum of
    them (their chunks' own checksums then need no check; their headers still do).

    Raises:
        ChecksumError: a pack of another length than its table's, or records whose bytes are not
            the ones the table's checksum is of.
    """
    view = memoryview(data)
    if len(view) != table.total_bytes:
        raise ChecksumError(f"layer pack is {len(view)} bytes, its table says {table.total_bytes}")
    if xxhash.xxh3_64_intdigest(view[table.offsets[0] :]) != table.records_checksum:
        raise ChecksumError("layer pack records checksum mismatch")
    return [view[a:b] for a, b in map(table.span, range(len(table.offsets)))]


def is_pack(data: bytes | memoryview) -> bool:
    """Whether a stored record starts like a layer pack (diagnostics; not a verification)."""
    return bytes(memoryview(data)[:4]) == MAGIC
