"""Choosing chunks under a byte budget from estimated attention mass (query-aware selection).

Per layer (or per KV head of a layer): the summary is read first and its bytes
count against the budget; chunks forced in (attention sinks, the most recent
chunk) come next while they fit; then chunks by descending estimated mass. A
fixed budget stops at its byte limit; `auto` stops once the chosen chunks hold
`coverage` of the estimated mass, within its min/max fractions.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from importance.summaries import AutoBudget, Budget, ChunkLayout, FixedBudget

Array = np.ndarray[Any, Any]


class ChunkChoice(NamedTuple):
    """Chunks chosen per row (a layer or one of its KV heads) and what they cost.

    Attributes:
        chosen: (rows, chunks) bool.
        delivered_fraction: per row, (chosen tokens + summary) / prefix tokens, in bytes.
        covered_mass: per row, the estimated mass the chosen chunks hold.
    """

    chosen: Array
    delivered_fraction: Array
    covered_mass: Array


def reads_summary(budget: Budget) -> bool:
    """Whether a load at `budget` reads the summary: not when it reads everything anyway."""
    return not (isinstance(budget, FixedBudget) and budget.fraction >= 1.0)


def edge_chunks(layout: ChunkLayout, sink_chunks: int, recent_chunks: int) -> Array:
    """Bool (chunks,): the chunks holding the first `sink_chunks` x chunk_tokens tokens and the last ones.

    With an importance layout the sink and recent tokens may spread over several chunks;
    every chunk holding one of them is marked.
    """
    n, c = layout.num_tokens, layout.chunk_tokens
    wanted = np.zeros(n, dtype=bool)
    wanted[: min(n, sink_chunks * c)] = True
    if recent_chunks:
        wanted[max(0, n - recent_chunks * c) :] = True
    marks = np.zeros(layout.num_chunks, dtype=bool)
    marks[layout.chunk_of_token()[wanted]] = True
    return marks


def choose_chunks(
    mass: Array,
    layout: ChunkLayout,
    budget: Budget,
    summary_fraction: float = 0.0,
    forced: Array | None = None,
) -> ChunkChoice:
    """Pick chunks per row of `mass` (rows, chunks) under `budget`.

    Args:
        mass: estimated attention share of each chunk, per row (rows need not sum to 1).
        layout: the chunks (their sizes count against the budget).
        budget: `FixedBudget` or `AutoBudget` (fractions of the prefix's KV bytes).
        summary_fraction: bytes of the summary read first, as a fraction of the prefix's.
        forced: bool (chunks,) taken first (in chunk order) while they fit.

    Never delivers more than the budget (or `max_fraction`): a chunk that does not
    fit is skipped and smaller ones after it may still be taken.

    Raises:
        ValueError: the budget is smaller than the summary alone.
    """
    mass = np.atleast_2d(np.asarray(mass, dtype=np.float64))
    sizes = layout.sizes
    n = layout.num_tokens
    if mass.shape[1] != len(sizes):
        raise ValueError(f"mass has {mass.shape[1]} chunks, the layout {len(sizes)}")
    cap, floor, coverage = _limits(budget, n, summary_fraction)
    forced = np.zeros(len(sizes), dtype=bool) if forced is None else np.asarray(forced, dtype=bool)
    chosen = np.zeros(mass.shape, dtype=bool)
    for row in range(mass.shape[0]):
        chosen[row] = _choose_row(mass[row], sizes, forced, cap, floor, coverage)
    tokens = (chosen * sizes).sum(axis=1)
    total = mass.sum(axis=1)
    covered = np.where(total > 0, (chosen * mass).sum(axis=1) / np.where(total > 0, total, 1.0), 0.0)
    return ChunkChoice(chosen, tokens / n + summary_fraction, covered)


def _limits(budget: Budget, n: int, summary_fraction: float) -> tuple[int, int, float | None]:
    """(max tokens, min tokens, coverage or None) left for chunks after the summary."""
    limit = budget.fraction if isinstance(budget, FixedBudget) else getattr(budget, "max_fraction", 1.0)
    if limit < summary_fraction:
        raise ValueError(
            f"budget {limit} is below what the summary alone reads ({summary_fraction:.4g} of the bytes): "
            "choose without the summary (static order) at this budget"
        )
    if isinstance(budget, FixedBudget):
        cap = int(np.floor((budget.fraction - summary_fraction) * n + 1e-9))
        return max(cap, 0), 0, None
    if isinstance(budget, AutoBudget):
        cap = int(np.floor((budget.max_fraction - summary_fraction) * n + 1e-9))
        floor = int(np.ceil((budget.min_fraction - summary_fraction) * n - 1e-9))
        return max(cap, 0), max(min(floor, cap), 0), budget.coverage
    raise TypeError(f"budget must be FixedBudget or AutoBudget, got {budget!r}")


def _choose_row(
    mass: Array, sizes: Array, forced: Array, cap: int, floor: int, coverage: float | None
) -> Array:
    total = mass.sum()
    ranked = np.argsort(-mass, kind="stable")
    order = np.concatenate([np.flatnonzero(forced), ranked[~forced[ranked]]])
    row = np.zeros(len(sizes), dtype=bool)
    used, held = 0, 0.0
    for chunk in order:
        reached = coverage is not None and used >= floor and total > 0 and held >= coverage * total
        if reached or used >= cap:
            break
        if used + sizes[chunk] <= cap:
            row[chunk] = True
            used += int(sizes[chunk])
            held += float(mass[chunk])
    return row


def mix_static(query_mass: Array, static_mass: Array, static_weight: float) -> Array:
    """Blend each row of query-aware mass with a static chunk mass (both normalised per row)."""
    if not 0.0 <= static_weight <= 1.0:
        raise ValueError(f"static_weight must be in [0, 1], got {static_weight}")
    q = np.atleast_2d(query_mass)
    q = q / np.clip(q.sum(axis=1, keepdims=True), 1e-30, None)
    s = np.asarray(static_mass, dtype=np.float64)
    s = s / max(s.sum(), 1e-30)
    return (1.0 - static_weight) * q + static_weight * s[None, :]
