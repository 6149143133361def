"""The engine's torch chunk score equals the numpy reference the quality benchmark simulates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_adapter.runner.chunk_mass import chunk_mass
from importance.query_select import choose_by_mass, choose_layer_chunks, query_chunk_mass
from importance.summaries import quantize_keys

DIM, KV_HEADS, QUERY_HEADS = 64, 3, 9
SCALE = DIM**-0.5


def _inputs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((KV_HEADS, n, DIM)).astype(np.float32) * 2.0
    keys[:, n // 3 : n // 3 + 24] *= 3.0  # a region some queries favour
    queries = rng.standard_normal((QUERY_HEADS, 16, DIM)).astype(np.float32) * 2.0
    return queries, quantize_keys(keys, 2, 256)


@pytest.mark.parametrize(("n", "chunk"), [(512, 8), (4096, 8), (1000, 8), (768, 4)])
def test_torch_mass_equals_the_numpy_reference(n: int, chunk: int) -> None:
    queries, keys = _inputs(n, n)
    expected = query_chunk_mass(queries, keys, chunk, SCALE)
    got = chunk_mass(torch.from_numpy(queries), torch.from_numpy(keys), chunk, SCALE)
    assert got.shape == expected.shape == (-(-n // chunk),)
    assert np.allclose(got, expected, rtol=1e-4, atol=1e-7) and abs(got.sum() - 1.0) < 1e-6


@pytest.mark.parametrize("count", [16, 64, 128])
def test_the_engine_chooses_the_chunks_the_benchmark_simulates(count: int) -> None:
    queries, keys = _inputs(4096, 7)
    simulated = choose_layer_chunks(queries, keys, count, scale=SCALE)
    mass = chunk_mass(torch.from_numpy(queries), torch.from_numpy(keys), 8, SCALE)
    assert np.array_equal(choose_by_mass(mass, 4096, count), simulated) and len(simulated) == count


def test_bad_shapes_are_refused_with_the_shapes_named() -> None:
    queries, keys = (torch.from_numpy(a) for a in _inputs(256, 1))
    with pytest.raises(ValueError, match="must be"):
        chunk_mass(queries[:, :, :8], keys, 8, SCALE)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        chunk_mass(queries[:8], keys, 8, SCALE)
    with pytest.raises(ValueError, match="chunks"):
        choose_by_mass(np.ones(3), 256, 2)
