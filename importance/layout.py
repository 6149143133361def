"""Importance-ordered layout of a block, and the choice of chunks to read under a budget.

Inside a block, tokens are stored by descending score, so that chunk 0 holds the
most important ones; reading the top k tokens of a block then reads only
ceil(k / chunk_tokens) leading chunks instead of nearly all of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np


def importance_order(scores: np.ndarray[Any, Any] | None, num_tokens: int) -> np.ndarray[Any, Any]:
    """Permutation (stored slot -> offset in block): descending score, ties in prompt order.

    With no scores the block keeps its natural order.
    """
    if scores is None:
        return np.arange(num_tokens, dtype=np.int64)
    return np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable").astype(np.int64)


class BlockSelection(NamedTuple):
    """What to read of one block: chunk indices (ascending) and the tokens they hold."""

    chunks: list[int]
    selected_tokens: int


class ChunkRanking(NamedTuple):
    """Every chunk of the matched blocks, best first: block, chunk index, tokens, value."""

    blocks: np.ndarray[Any, Any]
    chunks: np.ndarray[Any, Any]
    sizes: np.ndarray[Any, Any]
    values: np.ndarray[Any, Any]


ChunkTokens = int | Sequence[int]
"""Tokens per chunk: one size for every block, or one per block (blocks of different layouts)."""


def rank_chunks(
    slot_scores: Sequence[np.ndarray[Any, Any]], chunk_tokens: ChunkTokens, *, normalise: bool = False
) -> ChunkRanking:
    """Rank the chunks of the matched blocks by their tokens' current scores.

    The value of a chunk is its tokens' mean score: every chunk costs its size in
    bytes, so mean score is value per byte, and for equal-sized chunks it ranks
    exactly as the sum does. With `normalise`, the value is instead the chunk's
    share of the estimated attention mass: each block's (non-negative) scores
    divided by their sum (uniform if all zero), over the number of blocks, so all
    values sum to 1. Ties rank by chunk index, then block: unscored blocks share a
    budget evenly, each reading its leading chunks.
    """
    rows: list[np.ndarray[Any, Any]] = []
    sizes = (
        [int(chunk_tokens)] * len(slot_scores)
        if isinstance(chunk_tokens, int | np.integer)
        else list(chunk_tokens)
    )
    for b, (raw, size) in enumerate(zip(slot_scores, sizes, strict=True)):
        s = np.asarray(raw, dtype=np.float64)
        if normalise:
            s = np.clip(s, 0.0, None)
            total = s.sum()
            s = (s / total if total > 0 else np.full(len(s), 1.0 / max(1, len(s)))) / len(slot_scores)
        rows.append(_block_rows(b, s, size, normalise))
    table = np.concatenate(rows) if rows else np.zeros((0, 4), np.float64)
    order = np.lexsort((table[:, 0], table[:, 1], -table[:, 3]))
    table = table[order]
    ints = table[:, :3].astype(np.int64)
    return ChunkRanking(ints[:, 0], ints[:, 1], ints[:, 2], table[:, 3])


def _block_rows(block: int, scores: np.ndarray[Any, Any], size: int, as_sum: bool) -> np.ndarray[Any, Any]:
    """(block, chunk, tokens, value) rows of one block's chunks, computed in one pass
    (a loop over chunks cost ~0.8 ms of every 2,048-token load). Each value is the same
    float the loop computed (`part.sum()` / `part.mean()`: numpy's pairwise sum per row),
    so exact ties between chunks stay ties."""
    n = len(scores)
    full = n // size
    values = []
    if full:
        rows2d = np.ascontiguousarray(scores[: full * size]).reshape(full, size)
        values.append(rows2d.sum(axis=1) if as_sum else rows2d.mean(axis=1))
    if n % size:
        tail = scores[full * size :]
        values.append(np.array([tail.sum() if as_sum else tail.mean()]))
    counts = np.full(full + (n % size > 0), size, np.float64)
    if n % size:
        counts[-1] = n % size
    rows = np.empty((len(counts), 4), np.float64)
    rows[:, 0], rows[:, 1], rows[:, 2] = block, np.arange(len(counts)), counts
    rows[:, 3] = np.concatenate(values) if values else np.zeros(0)
    return rows


def _selection(ranking: ChunkRanking, taken: int, num_blocks: int) -> list[BlockSelection]:
    """The first `taken` chunks of `ranking`, grouped by block."""
    out = []
    for b in range(num_blocks):
        mine = ranking.blocks[:taken] == b
        out.append(
            BlockSelection(
                sorted(int(c) for c in ranking.chunks[:taken][mine]), int(ranking.sizes[:taken][mine].sum())
            )
        )
    return out


def _chunks_within(sizes: np.ndarray[Any, Any], budget_tokens: int) -> int:
    """How many leading chunks a token budget reads: each one starting below the budget.

    So the tokens delivered are at most the budget plus one partial chunk (the last).
    """
    before = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return int(np.count_nonzero(before < budget_tokens))


def select_chunks(
    slot_scores: Sequence[np.ndarray[Any, Any]], budget_tokens: int, chunk_tokens: ChunkTokens
) -> list[BlockSelection]:
    """Whole chunks, best mean score first, until they hold `budget_tokens` tokens.

    Args:
        slot_scores: per block, the score of each stored slot (in stored order).
        budget_tokens: tokens to deliver over all blocks.
        chunk_tokens: tokens per chunk (or per block, a size for each).

    Returns:
        Per block, the chunks to read. Their tokens total at most `budget_tokens`
        plus one partial chunk (less than `chunk_tokens` over it), over all blocks.
    """
    if not slot_scores:
        return []
    ranking = rank_chunks(slot_scores, chunk_tokens)
    return _selection(ranking, _chunks_within(ranking.sizes, budget_tokens), len(slot_scores))


class CoverageSelection(NamedTuple):
    """`select_by_coverage`'s choice and the estimated attention mass it holds, in [0, 1]."""

    blocks: list[BlockSelection]
    mass: float


def select_by_coverage(
    slot_scores: Sequence[np.ndarray[Any, Any]],
    chunk_tokens: ChunkTokens,
    coverage: float,
    min_tokens: int,
    max_tokens: int,
) -> CoverageSelection:
    """The fewest chunks whose estimated attention mass reaches `coverage`, within bounds.

    Chunks are taken by descending mass (see `rank_chunks(normalise=True)`): at least
    as many as a token budget of `min_tokens` reads, then more until the mass
    reaches `coverage`, but never more than a token budget of `max_tokens` reads.
    """
    if not slot_scores:
        return CoverageSelection([], 0.0)
    ranking = rank_chunks(slot_scores, chunk_tokens, normalise=True)
    low = _chunks_within(ranking.sizes, min_tokens)
    high = max(low, _chunks_within(ranking.sizes, max_tokens))
    mass_before = np.concatenate([[0.0], np.cumsum(ranking.values)[:-1]])
    # Float sums of shares that total 1 may land a hair under it: allow 1e-9.
    needed = int(np.count_nonzero(mass_before < coverage - 1e-9))
    taken = min(max(low, needed), high)
    return CoverageSelection(
        _selection(ranking, taken, len(slot_scores)), float(ranking.values[:taken].sum())
    )


def budget_to_tokens(budget: float, total_tokens: int) -> int:
    """Tokens selected by a fraction budget in (0, 1]: ceil(budget * total)."""
    return min(total_tokens, math.ceil(budget * total_tokens - 1e-9))


DEFAULT_MIN_CHANGE = 0.2
"""A block whose `layout_change` exceeds this is due for re-layout (`kvsieve relayout`)."""


def top_set(scores: np.ndarray[Any, Any], fraction: float) -> set[int]:
    """Offsets of the top `fraction` of a block's tokens by score (ties in prompt order)."""
    k = budget_to_tokens(fraction, len(scores))
    return {int(i) for i in importance_order(scores, len(scores))[:k]}


def layout_change(
    scores: np.ndarray[Any, Any], permutation: np.ndarray[Any, Any], fraction: float = 0.25
) -> float:
    """1 - Jaccard(top tokens by current scores, top tokens as laid out): 0 = layout still right."""
    now = top_set(scores, fraction)
    laid_out = {int(i) for i in permutation[: budget_to_tokens(fraction, len(permutation))]}
    union = now | laid_out
    return 1.0 - len(now & laid_out) / len(union) if union else 0.0


def chunks_for_top(
    scores: np.ndarray[Any, Any], permutation: np.ndarray[Any, Any], fraction: float, chunk_tokens: int
) -> int:
    """Chunks a block must read to deliver its top `fraction` tokens under `permutation`."""
    wanted = top_set(scores, fraction)
    slot_of = np.empty(len(permutation), dtype=np.int64)
    slot_of[np.asarray(permutation)] = np.arange(len(permutation))
    return len({int(slot_of[i]) // chunk_tokens for i in wanted})
