"""Chunk selection under a budget: rank every token of the matched blocks, pick chunks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from importance.layout import budget_to_tokens, select_chunks

BLOCK_TOKENS = 256
CHUNK_TOKENS = 16
BUDGET = 0.25


@pytest.mark.parametrize("num_tokens", [2048, 32768])
def test_select_chunks(benchmark: Any, num_tokens: int) -> None:
    rng = np.random.default_rng(0)
    # Stored in importance order: each block's slot scores descend.
    slot_scores = [np.sort(rng.random(BLOCK_TOKENS))[::-1] for _ in range(num_tokens // BLOCK_TOKENS)]
    budget = budget_to_tokens(BUDGET, num_tokens)
    selection = benchmark(select_chunks, slot_scores, budget, CHUNK_TOKENS)
    assert sum(s.selected_tokens for s in selection) == budget
