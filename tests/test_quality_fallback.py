"""The layered layout's static fallback in the quality benchmark (bench/quality/methods.py `static_c8*`)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.quality.methods import STATIC_CHUNK_TOKENS, static_chunks
from bench.quality.quality_bench import (
    AUTO,
    SHIPPED_CONFIG,
    WINDOWS_ENV,
    Job,
    _budget_for,
    _own_auto,
    windows,
)
from importance.summaries import FixedBudget


def _chunk_means(scores: np.ndarray) -> np.ndarray:
    starts = np.arange(0, len(scores), STATIC_CHUNK_TOKENS)
    return np.array([scores[s : s + STATIC_CHUNK_TOKENS].mean() for s in starts])


def _chosen_chunks(keep: np.ndarray) -> np.ndarray:
    """Chunk indices of a (1, tokens) mask, after checking that it holds whole chunks only."""
    flags = keep[0]
    starts = np.arange(0, len(flags), STATIC_CHUNK_TOKENS)
    for s in starts:
        part = flags[s : s + STATIC_CHUNK_TOKENS]
        assert part.all() or not part.any(), f"chunk at {s} is split"
    return np.flatnonzero(flags[starts])


def test_whole_prompt_order_chunks_by_mean_score_within_the_budget() -> None:
    rng = np.random.default_rng(7)
    scores = rng.random(100)  # 12 chunks of 8 and a last one of 4
    scores[8:16] = 2.0  # chunk 1: the best
    scores[96:] = 0.95  # the partial chunk 12: the second best mean, but a smaller sum than most
    means = _chunk_means(scores)
    sums = means * np.append(np.full(12, 8), 4)
    assert np.argsort(-means, kind="stable")[:2].tolist() == [1, 12] and (sums[2:12] > sums[12]).any()
    keep = static_chunks(scores, FixedBudget(0.16), edges=False)  # 16 tokens: never more
    assert keep.shape == (1, 100)
    # by mean: chunk 1 (8 tokens) and chunk 12 (4); no further 8-token chunk fits (ranking by
    # sum would have taken chunk 1 and the best full chunk instead)
    assert _chosen_chunks(keep).tolist() == [1, 12] and keep.sum() == 12


def test_edges_take_the_first_and_last_16_tokens_first() -> None:
    scores = np.zeros(96)
    scores[40:56] = 1.0  # the two best chunks sit in the middle
    plain = _chosen_chunks(static_chunks(scores, FixedBudget(0.25), edges=False))  # 24 tokens: 3 chunks
    edged = _chosen_chunks(static_chunks(scores, FixedBudget(0.5), edges=True))  # 48 tokens: 6 chunks
    assert set(plain) >= {5, 6}
    assert set(edged) == {0, 1, 10, 11, 5, 6}


def test_the_window_count_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WINDOWS_ENV, raising=False)
    assert windows() == 20
    monkeypatch.setenv(WINDOWS_ENV, "8")
    assert windows() == 8
    for bad in ("0", "-3", "eight", ""):
        monkeypatch.setenv(WINDOWS_ENV, bad)
        with pytest.raises(ValueError, match=f"{WINDOWS_ENV}.*{bad!r}"):
            windows()


def test_auto_rules_give_their_budgets() -> None:
    per_layer = Job("qa_lowbit2", "qa_lowbit2", "auto", SHIPPED_CONFIG)
    per_prefix = Job("qa_lowbit2:prefix", "qa_lowbit2", "auto", SHIPPED_CONFIG, "prefix")
    fallback = Job("static_c8", "static_c8", "auto", SHIPPED_CONFIG)
    assert _own_auto(per_layer) and not _own_auto(per_prefix) and not _own_auto(fallback)
    assert _budget_for(per_layer, None) == AUTO
    # the same count for every layer: the shipped per-layer rule's mean delivered fraction
    assert _budget_for(per_prefix, 0.317) == FixedBudget(0.317) == _budget_for(fallback, 0.317)
    with pytest.raises(ValueError, match="shipped"):
        _budget_for(per_prefix, None)
