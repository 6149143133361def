"""A layer's key summaries joined with their codes still packed, for a device to unpack.

The query-aware path scores each layer's chunks against that layer's key summaries. On a GPU the
scoring is one batched op on the device; decoding the summaries there too (engine_adapter/runner/
chunk_mass.py `device_keys`) moves a quarter of a byte per channel instead of four bytes of float32,
and leaves the unpacking to the device. This joins the blocks' verified records (kvstore/format/
key_summary.py `verify_summary`) side by side for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from importance.lowbit import LowBitKeys
from kvstore.errors import InvalidInputError
from kvstore.format.key_summary import PackedSummary
from kvstore.model import ModelSpec
from kvstore.values import Array


class PackedLayer(NamedTuple):
    """One layer's summaries over a prefix, codes packed: `codes` (blocks, packed bytes), `low` and
    `step` fp16 (blocks, kv_heads, groups, head_dim); each block's codes unpack to `shape`,
    (kv_heads, block tokens, head_dim), at `bits` bits, one offset group per `group_tokens`."""

    codes: Array
    low: Array
    step: Array
    bits: int
    shape: tuple[int, int, int]
    group_tokens: int


def join_packed(parts: Sequence[PackedSummary]) -> PackedLayer:
    """The blocks' summaries of one layer, in prefix order, as one `PackedLayer`.

    Raises:
        InvalidInputError: no blocks, or blocks of unlike geometry (decode them one by one instead).
    """
    if not parts or len({(p.shape, p.bits, p.group_tokens, len(p.codes)) for p in parts}) != 1:
        raise InvalidInputError("packed summaries need matched blocks of one geometry")
    first = parts[0]
    low, step = np.stack([p.low for p in parts]), np.stack([p.step for p in parts])
    return PackedLayer(
        np.stack([p.codes for p in parts]), low, step, first.bits, first.shape, first.group_tokens
    )


def join_lowbit(parts: list[LowBitKeys], model: ModelSpec) -> LowBitKeys:
    """Per-block summaries of one layer as one: every block is one group of its own tokens."""
    if not parts:
        empty = np.zeros((model.num_kv_heads, 0, model.head_dim), np.float16)
        return LowBitKeys(empty.astype(np.uint8), empty, empty, 2, 1)
    return LowBitKeys(
        np.concatenate([p.codes for p in parts], axis=1),
        np.concatenate([p.low for p in parts], axis=1),
        np.concatenate([p.step for p in parts], axis=1),
        parts[0].bits,
        parts[0].group_tokens,
    )
