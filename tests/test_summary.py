"""Summary records of the layered layout (kvstore/format/key_summary.py): round trip, corruption, identity."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from importance.lowbit import dequantize, quantize
from kvstore.errors import ChecksumError, InvalidInputError
from kvstore.format.chunk import ChunkId
from kvstore.format.key_summary import decode_summary, encode_summary, is_summary, summary_record_bytes

RID = ChunkId(b"f" * 16, b"n" * 16, b"k" * 16, 3, 1)


def _keys(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((3, 32, 8)) * rng.uniform(0.1, 5, (1, 1, 8))).astype(np.float16)


def test_round_trip_equals_lowbit_of_the_keys() -> None:
    keys = _keys()
    data = encode_summary(RID, keys)
    assert len(data) == summary_record_bytes(32, 3, 8) and is_summary(data)
    decoded = decode_summary(data, RID)
    assert decoded.record_id == RID
    expected = dequantize(quantize(keys.astype(np.float32), 2, 32))
    np.testing.assert_array_equal(decoded.dequantized(), expected)
    assert decoded.keys.codes.max() <= 3 and decoded.keys.bits == 2


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_encoding_in_torch_gives_numpys_codes_to_the_bit(bits: int, dtype: type) -> None:
    """The store quantises in torch; the simulation and the benchmark in numpy
    (importance.lowbit.quantize): codes, offsets and steps are the same, exact halves (ties to
    even) and constant channels included."""
    rng = np.random.default_rng(bits)
    keys = (rng.standard_normal((3, 256, 16)) * 4).astype(dtype)
    keys[:, ::3] = np.round(keys[:, ::3] * 2) / 2  # many exact halves of a step's multiples
    keys[:, :, 5] = 1.5  # a constant channel
    decoded = decode_summary(encode_summary(RID, keys, bits=bits), RID).keys
    expected = quantize(keys.astype(np.float32), bits, 256)
    for got, want in zip(decoded[:3], expected[:3], strict=True):
        np.testing.assert_array_equal(got, want)


def test_decoding_a_summary_never_loads_torch(tmp_path: Path) -> None:
    """A thin client decodes summaries (kvstore/client/layer_by_layer.py): torch is the encoder's."""
    record = tmp_path / "summary"
    record.write_bytes(encode_summary(RID, _keys()))
    code = (
        "import sys; from pathlib import Path; from kvstore.format.key_summary import decode_summary;"
        f"decode_summary(Path({str(record)!r}).read_bytes()).dequantized(); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_smollm2_size_is_the_documented_one() -> None:
    # 3 KV heads x 64 channels, 256 tokens at 2 bits: 12,288 B of codes + 768 B of fp16 offsets/steps.
    assert summary_record_bytes(256, 3, 64) - 83 == 13_056


@pytest.mark.parametrize("where", [0, 5, 40, 80, 200, -3])
def test_flipped_byte_is_a_checksum_error(where: int) -> None:
    data = bytearray(encode_summary(RID, _keys()))
    data[where] ^= 0x10
    with pytest.raises(ChecksumError):
        decode_summary(bytes(data), RID)


def test_a_record_never_answers_for_another_block_or_layer() -> None:
    data = encode_summary(RID, _keys())
    for other in (
        ChunkId(b"f" * 16, b"n" * 16, b"j" * 16, 3, 1),
        ChunkId(b"f" * 16, b"n" * 16, b"k" * 16, 4, 1),
        ChunkId(b"f" * 16, b"n" * 16, b"k" * 16, 3, 2),
        ChunkId(b"g" * 16, b"n" * 16, b"k" * 16, 3, 1),
    ):
        with pytest.raises(ChecksumError, match="identity mismatch"):
            decode_summary(data, other)


def test_truncated_and_foreign_records_are_refused() -> None:
    data = encode_summary(RID, _keys())
    with pytest.raises(ChecksumError):
        decode_summary(data[:-1], RID)
    with pytest.raises(ChecksumError, match="truncated"):
        decode_summary(data[:20], RID)


def test_bad_keys_are_refused_by_name() -> None:
    with pytest.raises(InvalidInputError, match="shape"):
        encode_summary(RID, np.zeros((3, 8)))
    with pytest.raises(InvalidInputError, match="bits"):
        encode_summary(RID, np.full((1, 2, 2), np.inf), bits=0)
