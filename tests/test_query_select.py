"""The shared per-layer query-aware chooser (importance/query_select.py), numpy only."""

from __future__ import annotations

import numpy as np
import pytest

from importance.query_select import choose_layer_chunks
from importance.selection import choose_chunks, edge_chunks
from importance.summaries import AutoBudget, ChunkLayout, FixedBudget, chunk_mass, quantize_keys, summarize

N, DIM, KV_HEADS, QUERY_HEADS = 512, 64, 3, 9
SCALE = DIM**-0.5


def _inputs(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((KV_HEADS, N, DIM)).astype(np.float32)
    keys[:, 200:216] *= 3.0  # a region the queries will favour
    queries = rng.standard_normal((QUERY_HEADS, 6, DIM)).astype(np.float32)
    return queries, keys


@pytest.mark.parametrize("budget", [FixedBudget(0.3), AutoBudget(0.9, 0.1, 0.5)])
def test_same_choice_as_the_summary_pipeline(budget: FixedBudget | AutoBudget) -> None:
    queries, keys = _inputs()
    layout = ChunkLayout.natural(N, 8)
    summary = summarize("lowbit2", keys, layout, 256)
    mass = chunk_mass(summary.chunk_logits(queries, SCALE), KV_HEADS, per_kv_head=False)
    expected = choose_chunks(mass, layout, budget, summary.bytes_fraction, edge_chunks(layout, 2, 2)).chosen[
        0
    ]
    chosen = choose_layer_chunks(
        queries, quantize_keys(keys, 2, 256), budget, scale=SCALE, summary_fraction=summary.bytes_fraction
    )
    assert np.array_equal(chosen, np.flatnonzero(expected)) and len(chosen) > 4


def test_a_chunk_count_is_exact_and_keeps_the_edges() -> None:
    queries, keys = _inputs(1)
    for count in (4, 5, 17, N // 8):
        chosen = choose_layer_chunks(queries, keys, count, scale=SCALE)
        assert len(chosen) == count and np.all(np.diff(chosen) > 0)
        assert {0, 1, N // 8 - 2, N // 8 - 1} <= set(chosen.tolist())
    favoured = choose_layer_chunks(queries * 0 + keys[:, 205].repeat(3, 0)[:, None], keys, 5, scale=SCALE)
    assert 25 in favoured.tolist()  # the one free chunk goes where the queries point (tokens 200..207)


def test_bad_input_names_the_problem() -> None:
    queries, keys = _inputs()
    with pytest.raises(ValueError, match="chunk count"):
        choose_layer_chunks(queries, keys, N // 8 + 1, scale=SCALE)
    with pytest.raises(ValueError, match="must be"):
        choose_layer_chunks(queries[:, :, :8], keys, 5, scale=SCALE)
    with pytest.raises(ValueError, match="summary"):
        choose_layer_chunks(queries, keys, FixedBudget(0.05), scale=SCALE, summary_fraction=0.066)
