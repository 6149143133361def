"""Low-bit keys: the key summary that query-aware selection reads before any chunk.

Every key is kept at `bits` bits per channel, with an fp16 offset and step per
channel, KV head and group of `group_tokens` tokens (a block). Keys have a few large
channels (RoPE pairs); per-channel steps keep the small ones from collapsing to zero
(as KIVI does for keys). The offsets and steps are rounded to fp16 *before* the codes
are computed, so what the store keeps (codes + fp16 offset/step) dequantises to
exactly what the quality benchmark simulates.

Pure numpy: the store encodes and decodes these, the engine and the benchmark
score chunks with the dequantised keys.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

Array = np.ndarray[Any, Any]


class LowBitKeys(NamedTuple):
    """Keys of one layer (or block of a layer) at `bits` bits per channel.

    Attributes:
        codes: uint8 (kv_heads, tokens, head_dim), each in [0, 2**bits).
        low: float16 (kv_heads, groups, head_dim): the value of code 0 per group.
        step: float16 (kv_heads, groups, head_dim): the value between two codes (> 0).
        bits: bits per code, 1..8.
        group_tokens: tokens sharing one offset and step.
    """

    codes: Array
    low: Array
    step: Array
    bits: int
    group_tokens: int


def quantize(keys: Array, bits: int, group_tokens: int) -> LowBitKeys:
    """Quantise keys (kv_heads, tokens, head_dim) per channel and group of tokens.

    Raises:
        ValueError: bits outside 1..8, group_tokens < 1, or keys not 3-D / not finite.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if group_tokens < 1:
        raise ValueError(f"group_tokens must be >= 1, got {group_tokens}")
    k = np.array(keys, dtype=np.float32)  # a copy: the codes are computed in it, in place
    if k.ndim != 3:
        raise ValueError(f"keys must be (kv_heads, tokens, head_dim), got shape {k.shape}")
    levels = (1 << bits) - 1
    heads, n, dim = k.shape
    groups = -(-n // group_tokens)
    codes = np.empty((heads, n, dim), dtype=np.uint8)
    low16 = np.empty((heads, groups, dim), dtype=np.float16)
    step16 = np.empty((heads, groups, dim), dtype=np.float16)
    for g in range(groups):
        part = k[:, g * group_tokens : (g + 1) * group_tokens]
        low, step = group_offsets(part.min(axis=1), part.max(axis=1), bits)
        low16[:, g], step16[:, g] = low, step
        # in place, the same operations as rint(clip((part - low) / step)): a store quantises every
        # layer's keys (6 MB of fp32 a block of SmolLM2), and new arrays there cost more than the math
        np.subtract(part, low[:, None].astype(np.float32), out=part)
        np.divide(part, step[:, None].astype(np.float32), out=part)
        np.rint(part, out=part)
        np.clip(part, 0, levels, out=part)
        codes[:, g * group_tokens : (g + 1) * group_tokens] = part
    return LowBitKeys(codes, low16, step16, bits, group_tokens)


def group_offsets(lowest: Array, highest: Array, bits: int) -> tuple[Array, Array]:
    """The fp16 offset and step of a group from its float32 minimum and maximum per channel:
    the offset never above the minimum, the step such that the top code reaches the maximum.

    Raises:
        ValueError: a minimum or maximum that is not finite (a NaN or inf anywhere shows here).
    """
    if not (np.isfinite(lowest).all() and np.isfinite(highest).all()):
        raise ValueError("keys must be finite")
    low = _fp16_at_most(lowest)
    span = highest - low.astype(np.float32)
    return low, _fp16_at_least(np.where(span > 0, span / ((1 << bits) - 1), 1.0))


def _fp16_at_most(x: Array) -> Array:
    """x rounded to fp16, never above x: code 0 never lies above the group's minimum."""
    h = x.astype(np.float16)
    return np.where(h.astype(np.float32) > x, np.nextafter(h, np.float16(-np.inf)), h)


def _fp16_at_least(x: Array) -> Array:
    """x rounded to fp16, never below x and above zero: the top code reaches the maximum."""
    h = x.astype(np.float16)
    h = np.where(h.astype(np.float32) < x, np.nextafter(h, np.float16(np.inf)), h)
    return np.where(h > 0, h, np.finfo(np.float16).tiny)


def dequantize(keys: LowBitKeys) -> Array:
    """The keys a `LowBitKeys` stands for: float32 (kv_heads, tokens, head_dim)."""
    heads, n, dim = keys.codes.shape
    g = keys.group_tokens
    groups = -(-n // g)
    low, step = keys.low.astype(np.float32), keys.step.astype(np.float32)
    if n == groups * g:  # whole groups (a store's blocks): broadcast, no gathered copies
        # two passes into one buffer (the uint8 codes are cast inside the multiply, no float
        # copy of them): a 4,096-token layer in ~0.9 ms, not ~1.4 ms (it runs 30 times a prefill)
        out = np.empty((heads, groups, g, dim), np.float32)
        np.multiply(keys.codes.reshape(heads, groups, g, dim), step[:, :, None], out=out)
        np.add(out, low[:, :, None], out=out)
        return out.reshape(heads, n, dim)
    group = np.arange(n) // g
    return low[:, group] + keys.codes.astype(np.float32) * step[:, group]


def pack_codes(codes: Array, bits: int) -> bytes:
    """Codes (any shape, each < 2**bits) packed `8 // bits` per byte, little-end first.

    For bits that do not divide 8 (3, 5, 6, 7), one code per byte.
    """
    flat = np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1)
    per_byte = 8 // bits if 8 % bits == 0 else 1
    if per_byte == 1:
        return flat.tobytes()
    pad = (-len(flat)) % per_byte
    rows = np.concatenate([flat, np.zeros(pad, np.uint8)]).reshape(-1, per_byte)
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits).astype(np.uint8)
    return np.bitwise_or.reduce(rows << shifts, axis=1).astype(np.uint8).tobytes()


def unpack_codes(data: bytes | memoryview | Array, bits: int, shape: tuple[int, ...]) -> Array:
    """Inverse of `pack_codes`: uint8 codes of `shape`.

    Raises:
        ValueError: `data` is not the size `shape` packs to.
    """
    count = int(np.prod(shape))
    per_byte = 8 // bits if 8 % bits == 0 else 1
    expected = -(-count // per_byte)
    raw = np.frombuffer(data, dtype=np.uint8)
    if len(raw) != expected:
        raise ValueError(f"packed codes are {len(raw)} bytes, {expected} expected for {shape} at {bits} bits")
    if per_byte == 1:
        return raw.reshape(shape).copy()
    codes = np.empty((len(raw), per_byte), dtype=np.uint8)
    mask = np.uint8((1 << bits) - 1)
    for i in range(per_byte):  # a few whole-array shifts: far cheaper than a gather per byte
        np.bitwise_and(np.right_shift(raw, i * bits), mask, out=codes[:, i])
    return codes.reshape(-1)[:count].reshape(shape)


def packed_bytes(tokens: int, kv_heads: int, head_dim: int, bits: int, group_tokens: int) -> int:
    """Bytes of a packed summary: codes plus fp16 offset and step per group, head and channel."""
    count = tokens * kv_heads * head_dim
    per_byte = 8 // bits if 8 % bits == 0 else 1
    groups = -(-tokens // group_tokens)
    return -(-count // per_byte) + 2 * 2 * kv_heads * groups * head_dim
