"""Key summary records of the layered layout: one per (block, layer), read before any chunk.

A summary holds the layer's keys of one block at `bits` bits per channel with an
fp16 offset and step per (kv head, group of `group_tokens` tokens, channel); the
math is importance/lowbit.py's, this module only frames it. Layout (little-endian)::

    header    struct _HEADER: magic "KVSS", version, the identity of the record
              (fingerprint, namespace digest, block key, layout version, record
              index: the same fields as a chunk's `ChunkId`, so a record can never
              answer for another block or layer), kv heads, head dim, tokens, bits,
              group tokens, length of the packed codes
    codes     importance.lowbit.pack_codes of (kv_heads, tokens, head_dim) codes
    low       fp16 (kv_heads, groups, head_dim)
    step      fp16 (kv_heads, groups, head_dim)
    checksum  u64 xxh3-64 over everything before it

For SmolLM2-135M (3 KV heads of 64 channels) a 256-token block at 2 bits is 13,056
bytes of codes, offsets and steps (plus 83 bytes of header and checksum) per layer:
6.6 % of that layer's fp16 KV.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import xxhash

from importance.lowbit import LowBitKeys, dequantize, group_offsets, pack_codes, packed_bytes, unpack_codes
from kvstore.errors import ChecksumError, InvalidInputError
from kvstore.format.chunk import ChunkId, GeometryError

Array = np.ndarray[Any, Any]

MAGIC = b"KVSS"
FORMAT_VERSION = 1
SUMMARY_BITS = 2
# magic, version, fingerprint, namespace digest, block key, layout version, record index,
# kv heads, head dim, tokens, bits, group tokens, packed codes length
_HEADER = struct.Struct("<4sH16s16s16sIIHHHBHI")
_CHECKSUM = struct.Struct("<Q")
#: Bytes of a record's header: its packed codes start here.
SUMMARY_HEADER_BYTES = _HEADER.size
#: Where `finite_keys` puts infinite keys: half fp16's largest value, so the span between the two
#: (a group's step at 1 bit) is still a finite fp16.
FINITE_LIMIT = float(np.finfo(np.float16).max) / 2


class SummaryGeometry(NamedTuple):
    """What a summary must describe: its block's tokens and the model's kv heads and head dim."""

    tokens: int
    kv_heads: int
    head_dim: int


class DecodedSummary(NamedTuple):
    """A verified summary record: its identity and its low-bit keys."""

    record_id: ChunkId
    keys: LowBitKeys

    def dequantized(self) -> Array:
        """The keys it stands for: float32 (kv_heads, tokens, head_dim)."""
        return dequantize(self.keys)


def encode_summary(record_id: ChunkId, keys: Array, bits: int = SUMMARY_BITS) -> bytes:
    """Quantise one block's keys of one layer, (kv_heads, tokens, head_dim), into a record.

    The whole block is one group (`group_tokens` = tokens), as docs/importance.md measured.
    Non-finite keys are summarised as `finite_keys` makes them (the block's KV is stored as given).

    Raises:
        InvalidInputError: keys not 3-D, or bits outside 1..8.
    """
    k = np.asarray(keys)
    if k.ndim != 3:
        raise InvalidInputError(f"summary keys must be (kv_heads, tokens, head_dim), got shape {k.shape}")
    tokens = k.shape[1]
    low_bit = _quantize(k, bits, tokens, k.shape[0])
    return _frame(record_id, low_bit, pack_codes(low_bit.codes, bits))


def finite_keys(keys: Array) -> Array:
    """float32 keys with NaN as 0 and infinities at `FINITE_LIMIT`.

    A summary only estimates where attention goes, so it takes any KV an engine hands over
    (a page pool's unused slots may hold anything): a NaN key scores as a zero key, an
    infinite one as a very large one. The stored KV itself keeps its bytes.
    """
    copy = as_float32(keys)  # a copy of its own: replaced in place
    return np.nan_to_num(copy, copy=False, nan=0.0, posinf=FINITE_LIMIT, neginf=-FINITE_LIMIT)


def _quantize(keys: Array, bits: int, tokens: int, rows: int) -> LowBitKeys:
    """`quantize` of `keys` as (rows, tokens, head_dim), one group of `tokens`, in a float32 copy of
    its own; non-finite keys go through `finite_keys` (only then: the check is on the min and max)."""
    if not 1 <= bits <= 8 or tokens < 1:
        raise InvalidInputError(
            f"summary keys: bits must be in 1..8 and tokens >= 1, got {bits} and {tokens}"
        )
    try:
        return _quantize_in_place(as_float32(keys).reshape(rows, tokens, -1), bits)
    except ValueError as exc:
        if np.isfinite(keys).all():
            raise InvalidInputError(f"summary keys: {exc}") from exc
    try:
        return _quantize_in_place(finite_keys(keys).reshape(rows, tokens, -1), bits)
    except ValueError as exc:
        raise InvalidInputError(f"summary keys: {exc}") from exc


def _quantize_in_place(keys: Array, bits: int) -> LowBitKeys:
    """`importance.lowbit.quantize(keys, bits, tokens)` of float32 `keys` (rows, tokens, head_dim),
    the block one group, computed in `keys` itself in torch: the same float32 operations (round half
    to even in both), so the same codes to the bit (tests/test_summary.py), at 2-3x numpy's speed
    (a store quantises every layer's keys: 6 MB of float32 a block of SmolLM2; numpy's reductions
    and element-wise passes were most of a layered store's time).

    Raises:
        ValueError: keys that are not finite.
    """
    import torch  # here: only encoding loads it (decoding is a thin client's work too)

    work = torch.from_numpy(keys)  # shares the memory: the passes below run in place
    low, step = group_offsets(work.amin(1).numpy(), work.amax(1).numpy(), bits)  # (aminmax: 5x slower)
    work.sub_(torch.from_numpy(low.astype(np.float32))[:, None])
    work.div_(torch.from_numpy(step.astype(np.float32))[:, None])
    work.round_().clamp_(0, (1 << bits) - 1)
    return LowBitKeys(work.to(torch.uint8).numpy(), low[:, None], step[:, None], bits, keys.shape[1])


def as_float32(keys: Array) -> Array:
    """`keys` as a float32 array of its own (a copy; float16 converted in torch, ~4x numpy's speed)."""
    k = np.asarray(keys)
    if k.dtype == np.float16:
        import torch  # here: only encoding loads it

        return torch.from_numpy(np.ascontiguousarray(k)).float().numpy()
    return k.astype(np.float32)


def prepare_encoding() -> None:
    """Load what encoding summaries uses (torch) now, not on the first store (~1 s)."""
    import torch  # noqa: F401


def encode_threads(threads: int) -> None:
    """Set torch's intra-op threads, which encoding summaries uses (process-wide: for a process that
    runs no model, kvstore/store/deferred.py `encode_on_one_thread`). A 256-token SmolLM2 block's
    30 layers on a loaded 2-core machine: 9.6 ms on one thread against 54-97 ms with two
    (quantisation alone 2.9 against 83-100): each op's threads spin for cores that are busy."""
    import torch  # here: only encoding loads it

    torch.set_num_threads(threads)


def encode_summaries(record_ids: Sequence[ChunkId], keys: Array, bits: int = SUMMARY_BITS) -> list[bytes]:
    """`encode_summary` of every layer of a block, `keys` (layers, kv_heads, tokens, head_dim),
    record i of `record_ids[i]`: the same bytes, made in one pass over all layers (quantising per
    channel is the same arithmetic whether the layers come one by one or stacked; a 256-token
    SmolLM2 block: 14 ms, not 26, most of a layered store's time).

    Raises:
        InvalidInputError: keys not 4-D or not one layer per record id; bits outside 1..8.
    """
    k = np.asarray(keys)
    if k.ndim != 4 or k.shape[0] != len(record_ids):
        raise InvalidInputError(
            f"summary keys must be (layers, kv_heads, tokens, head_dim) with {len(record_ids)} layers, "
            f"got shape {k.shape}"
        )
    layers, heads, tokens, dim = k.shape
    low_bit = _quantize(k, bits, tokens, layers * heads)  # every layer's heads as one batch
    codes = _pack_layers(low_bit.codes.reshape(layers, heads * tokens * dim), bits)
    frames = []
    for i, record_id in enumerate(record_ids):
        rows = slice(i * heads, (i + 1) * heads)  # layer i's heads
        layer = LowBitKeys(low_bit.codes[rows], low_bit.low[rows], low_bit.step[rows], bits, tokens)
        frames.append(_frame(record_id, layer, codes[i]))
    return frames


def _pack_layers(codes: Array, bits: int) -> list[bytes]:
    """`pack_codes` of each row of `codes` (layers, codes per layer): the same bytes. Rows that fill
    whole bytes are packed with a few whole-array operations: the `per_byte` codes of an output
    byte, read as one little-endian integer (code i at bit 8 i), land at bit i * bits when shifted
    right by i * (8 - bits); every other code of that integer lands at bit 8 or above, or below 0,
    and the mask drops it (numpy's `reduce` over a byte's few codes, and a shift-or per code in
    torch, each cost a pass and a temporary per code)."""
    per_byte = 8 // bits if 8 % bits == 0 else 1
    if per_byte == 1 or codes.shape[1] % per_byte:
        return [pack_codes(row, bits) for row in codes]
    words = np.ascontiguousarray(codes, dtype=np.uint8).view(f"<u{per_byte}")  # (layers, bytes out)
    packed = words.copy()
    for i in range(1, per_byte):
        packed |= words >> (i * (8 - bits))
    return [row.tobytes() for row in packed.astype(np.uint8)]  # the low byte: the mask


def _frame(record_id: ChunkId, low_bit: LowBitKeys, codes: bytes) -> bytes:
    """A summary record of one layer's quantised keys, `codes` packed."""
    heads, tokens, dim = low_bit.codes.shape
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, record_id.fingerprint, record_id.namespace, record_id.block_key,
        record_id.layout_version, record_id.chunk_index, heads, dim, tokens, low_bit.bits,
        low_bit.group_tokens, len(codes),
    )  # fmt: skip
    body = b"".join(
        (header, codes, low_bit.low.astype("<f2").tobytes(), low_bit.step.astype("<f2").tobytes())
    )
    return body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


class PackedSummary(NamedTuple):
    """A verified summary record with its codes still packed (`pack_codes`), for a reader that unpacks
    them elsewhere (on the model's device): identity, codes, fp16 low and step, geometry."""

    record_id: ChunkId
    codes: Array  # uint8, packed
    low: Array  # fp16 (kv_heads, groups, head_dim)
    step: Array
    bits: int
    group_tokens: int
    shape: tuple[int, int, int]  # (kv_heads, tokens, head_dim)


def verify_summary(
    data: bytes | memoryview, expect: ChunkId | None = None, geometry: SummaryGeometry | None = None
) -> PackedSummary:
    """Verify a summary record (the checksum is always checked: records are small); its codes stay
    packed (views of `data`).

    Raises:
        ChecksumError: not a summary record, truncated, checksum mismatch, sizes that do
            not add up, or an identity other than `expect`.
        GeometryError: tokens, kv heads or head dim other than `geometry`'s.
    """
    view = memoryview(data)
    if len(view) < _HEADER.size + _CHECKSUM.size:
        raise ChecksumError(f"summary record truncated: {len(view)} bytes")
    body, tail = view[: -_CHECKSUM.size], view[-_CHECKSUM.size :]
    if xxhash.xxh3_64_intdigest(body) != _CHECKSUM.unpack(tail)[0]:
        raise ChecksumError("summary record checksum mismatch")
    (magic, version, fp, ns, key, layout, index,
     heads, dim, tokens, bits, group, codes_len) = _HEADER.unpack_from(body)  # fmt: skip
    if magic != MAGIC or version != FORMAT_VERSION:
        raise ChecksumError(f"not a kvsieve summary record (magic {bytes(magic)!r}, version {version})")
    record_id = ChunkId(fp, ns, key, layout, index)
    if expect is not None and record_id != expect:
        raise ChecksumError(f"summary identity mismatch: expected {expect}, found {record_id}")
    if geometry is not None and (tokens, heads, dim) != geometry:
        found = (tokens, heads, dim)
        raise GeometryError(
            f"summary header says (tokens, kv heads, head dim) {found}; expected {tuple(geometry)}"
        )
    sizes_ok = 1 <= bits <= 8 and group >= 1
    if not sizes_ok or _HEADER.size + packed_bytes(tokens, heads, dim, bits, group) != len(body):
        raise ChecksumError("summary header does not match its length")
    groups = -(-tokens // group)
    codes = np.frombuffer(body[_HEADER.size : _HEADER.size + codes_len], dtype=np.uint8)
    off = _HEADER.size + codes_len
    side = heads * groups * dim * 2
    low = np.frombuffer(body[off : off + side], dtype="<f2").reshape(heads, groups, dim)
    step = np.frombuffer(body[off + side : off + 2 * side], dtype="<f2").reshape(heads, groups, dim)
    return PackedSummary(record_id, codes, low, step, bits, group, (heads, tokens, dim))


def decode_summary(
    data: bytes | memoryview, expect: ChunkId | None = None, geometry: SummaryGeometry | None = None
) -> DecodedSummary:
    """Verify and decode a summary record: `verify_summary`, its codes unpacked.

    Raises:
        ChecksumError, GeometryError: as `verify_summary`.
    """
    packed = verify_summary(data, expect, geometry)
    codes = unpack_codes(packed.codes, packed.bits, packed.shape)
    return DecodedSummary(
        packed.record_id, LowBitKeys(codes, packed.low, packed.step, packed.bits, packed.group_tokens)
    )


def summary_record_bytes(tokens: int, kv_heads: int, head_dim: int, bits: int = SUMMARY_BITS) -> int:
    """Encoded bytes of one summary record of a `tokens`-token block (header and checksum included)."""
    return _HEADER.size + packed_bytes(tokens, kv_heads, head_dim, bits, tokens) + _CHECKSUM.size


def is_summary(data: bytes | memoryview) -> bool:
    """Whether a stored record starts like a summary (fsck's diagnostics; not a verification)."""
    return bytes(memoryview(data)[:4]) == MAGIC
