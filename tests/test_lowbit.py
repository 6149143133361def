"""Low-bit key summaries: quantisation bounds, packing round trips, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from importance.lowbit import dequantize, pack_codes, packed_bytes, quantize, unpack_codes


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_dequantised_keys_are_within_half_a_step(bits: int) -> None:
    rng = np.random.default_rng(bits)
    keys = rng.normal(size=(3, 300, 64)).astype(np.float32) * np.linspace(0.1, 20, 64, dtype=np.float32)
    q = quantize(keys, bits, group_tokens=256)
    assert q.low.shape == (3, 2, 64) and q.low.dtype == np.float16
    assert int(q.codes.max()) <= (1 << bits) - 1
    error = np.abs(dequantize(q) - keys)
    step = q.step.astype(np.float32)[:, np.arange(300) // 256]
    # half a step, plus fp16 rounding of the offset and of the step times the code
    assert bool(np.all(error <= 0.5 * step + 1e-2 * np.abs(keys) + 1e-2))


@pytest.mark.parametrize(("bits", "group"), [(1, 256), (2, 256), (2, 100), (4, 7), (8, 300)])
def test_codes_are_numpys_rounding_to_the_bit(bits: int, group: int) -> None:
    """quantize runs in torch; the codes are numpy's rint(clip((k - low) / step)) in float32, ties
    to even included (keys placed exactly half a step apart make ties)."""
    rng = np.random.default_rng(bits * group)
    keys = rng.normal(size=(3, 300, 64)).astype(np.float32) * 4
    keys[:, ::5] = np.round(keys[:, ::5] * 2) / 2  # many exact halves
    q = quantize(keys, bits, group_tokens=group)
    expected = np.empty_like(q.codes)
    for g in range(-(-300 // group)):
        part = keys[:, g * group : (g + 1) * group]
        low, step = q.low[:, g : g + 1].astype(np.float32), q.step[:, g : g + 1].astype(np.float32)
        expected[:, g * group : (g + 1) * group] = np.clip(np.rint((part - low) / step), 0, (1 << bits) - 1)
        assert bool(np.all(low[:, 0] <= part.min(axis=1)))  # code 0 never above the group's minimum
    assert np.array_equal(q.codes, expected)


@pytest.mark.parametrize("bits", [1, 2, 4, 5, 8])
def test_codes_pack_and_unpack_exactly(bits: int) -> None:
    rng = np.random.default_rng(7)
    codes = rng.integers(0, 1 << bits, size=(3, 37, 5), dtype=np.uint8)
    packed = pack_codes(codes, bits)
    assert len(packed) == -(-codes.size // (8 // bits if 8 % bits == 0 else 1))
    assert np.array_equal(unpack_codes(packed, bits, codes.shape), codes)


def test_packed_size_of_a_smollm2_block_layer() -> None:
    # 256 tokens x 3 heads x 64 channels at 2 bits + fp16 offset/step per channel and head
    assert packed_bytes(256, 3, 64, 2, 256) == 12288 + 768


def test_constant_channel_dequantises_exactly() -> None:
    keys = np.full((1, 16, 4), 3.0, dtype=np.float32)
    assert np.array_equal(dequantize(quantize(keys, 2, 16)), keys)


@pytest.mark.parametrize(
    ("keys", "bits", "group", "message"),
    [
        (np.zeros((1, 4, 4)), 0, 4, "bits"),
        (np.zeros((1, 4, 4)), 2, 0, "group_tokens"),
        (np.zeros((4, 4)), 2, 4, "kv_heads"),
        (np.full((1, 4, 4), np.nan), 2, 4, "finite"),
    ],
)
def test_bad_input_names_the_problem(keys: np.ndarray, bits: int, group: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        quantize(keys, bits, group)


def test_unpack_rejects_a_wrong_size() -> None:
    with pytest.raises(ValueError, match="bytes"):
        unpack_codes(b"\x00" * 3, 2, (4, 4))
