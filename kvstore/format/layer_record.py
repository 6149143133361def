"""Layer records of the layered layout (v2): all chunks of one layer of one block in one record.

A layered block (kvstore/load/read_layered.py) stores one such record per layer. Its
chunks are `chunk_tokens` positions each, in prompt order (positions are implied:
block start + c * chunk_tokens + i), chunk-major, each one checksummed and (for
shuffle-zstd) compressed on its own, so that a reader can fetch the header and then
only the byte ranges of the chunks it wants. Layout (little-endian)::

    header    struct _HEADER: magic "KVSL", version, codec, dtype, the identity of the
              record (fingerprint, namespace digest, block key, layout version, record
              index: a `ChunkId`), kv heads, head dim, chunk tokens, number of chunks
    table     per chunk: offset u32 (from the record's start), length u32, xxh3-64 u64
              of the chunk's stored bytes
    checksum  u64 xxh3-64 over header and table
    chunks    chunk c: raw (2, kv_heads, chunk_tokens, head_dim) in the dtype, or that
              array shuffled and zstd-compressed (kvstore/format/chunk.py's shuffle-zstd)

The header's size depends only on the number of chunks (`header_bytes`), so a reader
that knows the block's chunk count reads it with one range request.

A header is never trusted about geometry: a reader passes the `LayerGeometry` its block's
metadata and the model imply (chunk tokens, chunk count, record index, dtype, kv heads,
head dim) and `parse_header` refuses any other with `GeometryError` before a byte is used.
"""

from __future__ import annotations

import functools
import itertools
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import xxhash

from kvstore.errors import ChecksumError, InvalidInputError
from kvstore.format.chunk import (
    CODEC_IDS,
    ChunkId,
    GeometryError,
    decompress_unshuffle,
    shuffle_compress,
    verify_header,
)
from kvstore.model import DTYPE_IDS, numpy_dtype

Array = np.ndarray[Any, Any]

MAGIC = b"KVSL"
FORMAT_VERSION = 2  # the layered layout's version 1 stored one record per chunk (never shipped)
# magic, version, codec, dtype, fingerprint, namespace digest, block key, layout version,
# record index, kv heads, head dim, chunk tokens, number of chunks
_HEADER = struct.Struct("<4sHBB16s16s16sIIHHHI")
_ENTRY = np.dtype([("offset", "<u4"), ("length", "<u4"), ("checksum", "<u8")])
_CHECKSUM = struct.Struct("<Q")
_CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}
_DTYPE_NAMES = {v: k for k, v in DTYPE_IDS.items()}


class LayerGeometry(NamedTuple):
    """What a layer record must describe: its block's metadata and the model say so."""

    record_index: int  # the layer's record (kvstore.format.block_meta.BlockMeta.record_index)
    chunk_tokens: int
    num_chunks: int
    dtype_name: str
    kv_heads: int
    head_dim: int


class LayerHeader(NamedTuple):
    """A verified layer record header: what a reader needs to find and decode any chunk."""

    record_id: ChunkId
    codec: str
    dtype_name: str
    kv_heads: int
    head_dim: int
    chunk_tokens: int
    offsets: list[int]  # per chunk, from the record's start
    lengths: list[int]  # per chunk, stored bytes
    checksums: list[int]  # per chunk, xxh3-64 of its stored bytes
    size: int  # bytes of header, table and header checksum
    total_bytes: int  # bytes of the whole record
    dtype: np.dtype[Any]  # the numpy dtype of the KV

    @property
    def num_chunks(self) -> int:
        """Chunks in the record."""
        return len(self.offsets)

    @property
    def geometry(self) -> LayerGeometry:
        """What the header says about the record's geometry."""
        return LayerGeometry(
            self.record_id.chunk_index, self.chunk_tokens, self.num_chunks, self.dtype_name,
            self.kv_heads, self.head_dim,
        )  # fmt: skip

    def chunk_shape(self) -> tuple[int, int, int, int]:
        """(2, kv_heads, chunk_tokens, head_dim): one decoded chunk."""
        return (2, self.kv_heads, self.chunk_tokens, self.head_dim)

    def ranges(self, chunks: Sequence[int]) -> list[tuple[int, int, list[int]]]:
        """(start, end, chunks) byte ranges covering sorted `chunks`, adjacent chunks merged."""
        runs: list[tuple[int, int, list[int]]] = []
        for c in chunks:
            start, length = self.offsets[c], self.lengths[c]
            if runs and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], start + length, [*runs[-1][2], c])
            else:
                runs.append((start, start + length, [c]))
        return runs


def header_bytes(num_chunks: int) -> int:
    """Bytes of a layer record's header, table and header checksum for `num_chunks` chunks."""
    return _HEADER.size + num_chunks * _ENTRY.itemsize + _CHECKSUM.size


def encode_layer_record(
    record_id: ChunkId, kv: Array, dtype: str, chunk_tokens: int, codec: str = "raw", zstd_level: int = 1
) -> bytes:
    """Encode one layer of one block, `kv` (2, kv_heads, tokens, head_dim) in prompt order.

    Raises:
        InvalidInputError: as `layer_record_parts`.
    """
    return b"".join(layer_record_parts(record_id, kv, dtype, chunk_tokens, codec, zstd_level))


def layer_record_parts(
    record_id: ChunkId, kv: Array, dtype: str, chunk_tokens: int, codec: str = "raw", zstd_level: int = 1
) -> list[bytes | memoryview]:
    """`encode_layer_record`'s bytes in parts (header, then each chunk's stored bytes), not joined:
    a layer pack joins every layer's parts once (kvstore/format/layer_pack.py `encode_pack`).

    Raises:
        InvalidInputError: unknown codec, a shape other than the above, or tokens not a
            multiple of `chunk_tokens`.
    """
    if codec not in CODEC_IDS:
        raise InvalidInputError(f"codec must be one of {sorted(CODEC_IDS)}, got {codec!r}")
    check_layer_kv(kv, chunk_tokens)
    _, heads, tokens, dim = kv.shape
    n = tokens // chunk_tokens
    # chunk-major: (chunks, 2, heads, chunk_tokens, dim), each chunk contiguous
    chunked = np.ascontiguousarray(kv.reshape(2, heads, n, chunk_tokens, dim).transpose(2, 0, 1, 3, 4))
    flat = chunked.reshape(n, -1).view(np.uint8)
    if codec == "raw":
        payloads: list[Any] = [flat[c].data for c in range(n)]
    else:
        payloads = [shuffle_compress(flat[c], kv.dtype.itemsize, zstd_level) for c in range(n)]
    table = np.zeros(n, _ENTRY)
    lengths = np.array([len(p) if isinstance(p, bytes) else p.nbytes for p in payloads], np.int64)
    table["length"] = lengths
    table["offset"] = header_bytes(n) + np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    table["checksum"] = [xxhash.xxh3_64_intdigest(p) for p in payloads]
    head = _HEADER.pack(
        MAGIC, FORMAT_VERSION, CODEC_IDS[codec], DTYPE_IDS[dtype], record_id.fingerprint,
        record_id.namespace, record_id.block_key, record_id.layout_version, record_id.chunk_index,
        heads, dim, chunk_tokens, n,
    )  # fmt: skip
    body = head + table.tobytes()
    return [body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body)), *payloads]


def check_layer_kv(kv: Array, chunk_tokens: int) -> None:
    """Refuse a layer's `kv` other than (2, heads, tokens, dim), tokens a multiple of `chunk_tokens`."""
    if kv.ndim != 4 or kv.shape[0] != 2 or chunk_tokens < 1 or kv.shape[2] % chunk_tokens:
        raise InvalidInputError(
            f"layer kv must be (2, heads, tokens, dim), tokens a multiple of {chunk_tokens}; got {kv.shape}"
        )


def write_headers(
    rows: Array, record_ids: Sequence[ChunkId], dtype: str, shape: tuple[int, int, int], checksums: Array
) -> None:
    """Write the header, chunk table and header checksum of raw records whose chunks `rows` holds already
    (row i: record `record_ids[i]`, `header_bytes(n)` then n chunks of (2, kv_heads, chunk_tokens,
    head_dim) in `dtype`; `shape`: (kv_heads, chunk_tokens, head_dim)), `checksums[i, c]` of chunk c.

    What `layer_record_parts` writes, for all records at once: kvstore/format/layer_pack.py
    `encode_raw_pack` builds a pack in place (one copy of the KV, no Python per chunk).
    """
    heads, chunk_tokens, dim = shape
    records, n = checksums.shape
    size, chunk = header_bytes(n), (rows.shape[1] - header_bytes(n)) // max(n, 1)
    fixed, tail = (MAGIC, FORMAT_VERSION, CODEC_IDS["raw"], DTYPE_IDS[dtype]), (heads, dim, chunk_tokens, n)
    headers = b"".join(
        _HEADER.pack(*fixed, r.fingerprint, r.namespace, r.block_key, r.layout_version, r.chunk_index, *tail)
        for r in record_ids
    )
    rows[:, : _HEADER.size] = np.frombuffer(headers, np.uint8).reshape(records, _HEADER.size)
    table = rows[:, _HEADER.size : _HEADER.size + n * _ENTRY.itemsize].view(_ENTRY)  # (records, n)
    table["offset"], table["length"], table["checksum"] = size + np.arange(n) * chunk, chunk, checksums
    body = size - _CHECKSUM.size  # a header's checksum is of its header and table
    sums = [xxhash.xxh3_64_intdigest(row[:body]) for row in rows]
    rows[:, body:size] = np.array(sums, "<u8").view(np.uint8).reshape(records, _CHECKSUM.size)


def parse_header(
    data: bytes | memoryview, expect: ChunkId | None = None, geometry: LayerGeometry | None = None
) -> LayerHeader:
    """Verify and parse the header at the start of `data` (the header range or the whole record).

    `geometry`: what the reader's block metadata and model imply; any other is refused.

    Raises:
        ChecksumError: not a layer record, truncated, header checksum mismatch, a table
            that does not describe adjacent chunks after the header, or another identity
            (fingerprint, namespace, block key, layout version).
        GeometryError: another record index (layer), chunk size, chunk count, dtype, kv
            heads or head dim than `geometry` (or `expect`'s record index).
    """
    view = memoryview(data)
    if len(view) < _HEADER.size or bytes(view[:4]) != MAGIC:
        raise ChecksumError(f"not a kvsieve layer record (starts {bytes(view[:4])!r}, {len(view)} bytes)")
    (_magic, version, codec_id, dtype_id, fp, ns, key, layout, index,
     heads, dim, chunk_tokens, n) = _HEADER.unpack_from(view)  # fmt: skip
    size = header_bytes(n)
    if geometry is not None and len(view) < size and n != geometry.num_chunks:
        raise GeometryError(f"layer record header says {n} chunks; expected {geometry.num_chunks}")
    verify_header(view, size, version, FORMAT_VERSION, "layer record header")
    record_id = ChunkId(fp, ns, key, layout, index)
    if expect is not None and record_id != expect:
        if expect == ChunkId(fp, ns, key, layout, expect.chunk_index):  # only the layer differs
            raise GeometryError(
                f"layer record identity mismatch: record index {index} (another layer's record) "
                f"where record {expect.chunk_index} was expected"
            )
        raise ChecksumError(f"layer record identity mismatch: expected {expect}, found {record_id}")
    table = _table(n).unpack_from(view, _HEADER.size)  # struct, not numpy: ~3x faster for 32 chunks
    offsets, lengths = list(table[0::3]), list(table[1::3])
    # each chunk right after the one before (accumulate: C speed, 240 headers a 2,048-token load)
    adjacent = n == 0 or offsets == list(itertools.accumulate(lengths[:-1], initial=size))
    if codec_id not in _CODEC_NAMES or dtype_id not in _DTYPE_NAMES or not adjacent:
        raise ChecksumError(
            "layer record header has an unknown codec or dtype or a table that does not add up"
        )
    if geometry is not None:
        found = LayerGeometry(index, chunk_tokens, n, _DTYPE_NAMES[dtype_id], heads, dim)
        if found != geometry:
            raise _mismatch(found, geometry)
    return LayerHeader(
        record_id,
        _CODEC_NAMES[codec_id],
        _DTYPE_NAMES[dtype_id],
        heads,
        dim,
        chunk_tokens,
        offsets,
        lengths,
        list(table[2::3]),
        size,
        offsets[-1] + lengths[-1] if n else size,
        numpy_dtype(_DTYPE_NAMES[dtype_id]),
    )


_INDEX_AT = _HEADER.size - 14  # the record index: u32 before kv heads, head dim, chunk tokens (u16), n (u32)


def headers_like(
    first: LayerHeader, data: memoryview, start: int, stride: int, indices: Sequence[int]
) -> list[LayerHeader] | None:
    """The headers of records at `start + i * stride` in `data` (`first`'s record the first of them)
    if each is `first`'s byte for byte but for its record index (`indices[i]`), its chunks'
    checksums and its header checksum; else None (parse them one by one then).

    For records whose bytes are verified already (a layer pack's records checksum, or memory):
    their header checksums are not checked again, everything else a header says is `first`'s
    (identity but the index, geometry, codec, chunk table offsets and lengths), compared for
    all records at once where `parse_header` takes ~20 us of Python each (240 a 2,048-token load).
    """
    size, n = first.size, first.num_chunks
    if len(indices) == 0 or start + (len(indices) - 1) * stride + size > len(data):
        return None
    rows: Array = np.ndarray((len(indices), size), np.uint8, buffer=data, offset=start, strides=(stride, 1))
    same = np.ones(size, bool)
    same[_INDEX_AT : _INDEX_AT + 4] = False
    entries = same[_HEADER.size : _HEADER.size + n * _ENTRY.itemsize].reshape(n, _ENTRY.itemsize)
    entries[:, 8:] = False  # each chunk's checksum
    same[size - _CHECKSUM.size :] = False
    if not np.array_equal(rows[:, same], np.broadcast_to(rows[0, same], (len(indices), int(same.sum())))):
        return None
    found = rows[:, _INDEX_AT : _INDEX_AT + 4].copy().view("<u4").ravel()
    if found.tolist() != list(indices) or found[0] != first.record_id.chunk_index:
        return None
    checksums = rows[:, _HEADER.size : _HEADER.size + n * _ENTRY.itemsize].copy().view(_ENTRY)["checksum"]
    rid = first.record_id
    return [
        first._replace(
            record_id=ChunkId(rid.fingerprint, rid.namespace, rid.block_key, rid.layout_version, i),
            checksums=c,
        )
        for i, c in zip(indices, checksums.tolist(), strict=True)
    ]


@functools.lru_cache(maxsize=64)
def _table(num_chunks: int) -> struct.Struct:
    """The chunk table of `num_chunks` entries (offset, length, checksum) as one struct."""
    return struct.Struct("<" + "IIQ" * num_chunks)


def _mismatch(found: LayerGeometry, expected: LayerGeometry) -> GeometryError:
    """The error for a header that says `found` where the block and model imply `expected`."""
    wrong = [
        f"{name} {a!r} (expected {b!r})"
        for name, a, b in zip(found._fields, found, expected, strict=True)
        if a != b
    ]
    return GeometryError(f"layer record header says {', '.join(wrong)}")


def decode_run(
    header: LayerHeader, data: bytes | memoryview, chunks: Sequence[int], trusted: bool = False
) -> Array:
    """Decode adjacent, ascending chunks `chunks` whose stored bytes are `data` (one range of `ranges`):
    (len(chunks), 2, kv_heads, chunk_tokens, head_dim). Each chunk's checksum is verified
    unless `trusted` (buffers the memory tier holds, written by this process).

    Raises:
        ChecksumError: a length or checksum mismatch, or a payload that does not decompress.
    """
    view = memoryview(data)
    base = header.offsets[chunks[0]] if chunks else 0
    expected = header.offsets[chunks[-1]] + header.lengths[chunks[-1]] - base if chunks else 0
    if len(view) != expected:
        raise ChecksumError(f"layer record chunks {list(chunks)}: {len(view)} bytes, expected {expected}")
    shape = header.chunk_shape()
    if header.codec == "raw":
        if not trusted:
            _verify(header, view, base, chunks)
        return np.frombuffer(view, header.dtype).reshape(len(chunks), *shape)
    out = np.empty((len(chunks), *shape), header.dtype)
    for i, c in enumerate(chunks):
        start = header.offsets[c] - base
        part = view[start : start + header.lengths[c]]
        if not trusted:
            _verify(header, part, start + base, [c])
        out[i] = decompress_unshuffle(part, header.dtype.itemsize).view(header.dtype).reshape(shape)
    return out


def decode_layer_record(
    data: bytes | memoryview, expect: ChunkId | None = None, trusted: bool = False,
    header: LayerHeader | None = None, geometry: LayerGeometry | None = None,
) -> tuple[LayerHeader, Array]:  # fmt: skip
    """Verify and decode a whole record: its header and (num_chunks, 2, kv_heads, chunk_tokens,
    head_dim) chunks (a read-only view of `data` for raw records). `header`: this record's
    header, already verified (a trusted record's, kept by the caller), is not parsed again;
    it too must describe `geometry`.

    Raises:
        ChecksumError: as `parse_header` and `decode_run`, or trailing bytes.
        GeometryError: as `parse_header`.
    """
    if header is None:
        header = parse_header(data, expect, geometry)
    elif geometry is not None and header.geometry != geometry:
        raise _mismatch(header.geometry, geometry)
    view = memoryview(data)
    if len(view) != header.total_bytes:
        raise ChecksumError(f"layer record is {len(view)} bytes, its header says {header.total_bytes}")
    return header, decode_run(header, view[header.size :], range(header.num_chunks), trusted)


def raw_layer_record(data: bytes | memoryview) -> bytes:
    """The same record re-encoded uncompressed (what the memory tier holds: no zstd on reads)."""
    header, chunks = decode_layer_record(data)
    return bytes(data) if header.codec == "raw" else raw_from_chunks(header, chunks)


def raw_from_chunks(header: LayerHeader, chunks: Array) -> bytes:
    """A raw layer record of `header`'s identity from its decoded (chunks, 2, heads, c, dim) chunks."""
    n, c = header.num_chunks, header.chunk_tokens
    kv = chunks.transpose(1, 2, 0, 3, 4).reshape(2, header.kv_heads, n * c, header.head_dim)
    return encode_layer_record(header.record_id, kv, header.dtype_name, c, "raw")


def is_layer_record(data: bytes | memoryview) -> bool:
    """Whether a stored record starts like a layer record (diagnostics; not a verification)."""
    return bytes(memoryview(data)[:4]) == MAGIC


def _verify(header: LayerHeader, view: memoryview, base: int, chunks: Sequence[int]) -> None:
    """Check the checksums of `chunks`, whose bytes lie in `view` from record offset `base`."""
    offsets, lengths, checksums = header.offsets, header.lengths, header.checksums
    digest = xxhash.xxh3_64_intdigest  # 32 chunks a record, 7,920 a 2,048-token load: names looked up once
    for c in chunks:
        start = offsets[c] - base
        if digest(view[start : start + lengths[c]]) != checksums[c]:
            raise ChecksumError(f"layer record chunk {c} checksum mismatch")
