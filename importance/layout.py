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
    """What to read of one block: chunk indices and how many of its tokens were selected."""

    chunks: list[int]
    selected_tokens: int


def select_chunks(
    slot_scores: Sequence[np.ndarray[Any, Any]], budget_tokens: int, chunk_tokens: int
) -> list[BlockSelection]:
    """Rank all tokens of the matched blocks and pick the chunks that hold the top ones.

    Args:
        slot_scores: per block, the score of each stored slot (in stored order).
        budget_tokens: how many tokens to select over all blocks.
        chunk_tokens: tokens per chunk.

    Ties rank by slot, then by block: unscored blocks (all zeros) then share the
    budget evenly and each reads its leading chunks.
    """
    if not slot_scores:
        return []
    scores = np.concatenate([np.asarray(s, dtype=np.float64) for s in slot_scores])
    slots = np.concatenate([np.arange(len(s)) for s in slot_scores])
    blocks = np.concatenate([np.full(len(s), b) for b, s in enumerate(slot_scores)])
    budget_tokens = max(0, min(budget_tokens, len(scores)))
    order = np.lexsort((blocks, slots, -scores))[:budget_tokens]
    out = []
    for b in range(len(slot_scores)):
        chosen = slots[order][blocks[order] == b]
        out.append(BlockSelection(sorted({int(s) // chunk_tokens for s in chosen}), len(chosen)))
    return out


def budget_to_tokens(budget: float, total_tokens: int) -> int:
    """Tokens selected by a fraction budget in (0, 1]: ceil(budget * total)."""
    return min(total_tokens, math.ceil(budget * total_tokens - 1e-9))


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
