"""The query-aware chunk choice of one layer: shared by the engine and the quality benchmark.

A request's new tokens bring their queries (post-RoPE, at their true positions);
each layer scores the prefix's chunks of consecutive tokens against approximate
keys decoded from the key summary (for `lowbit2`: every key at 2 bits), forces the
prefix's first and last tokens in (attention sinks and the recent context), then
takes chunks by estimated attention mass until the budget is spent. The engine's
layer-by-layer load (engine_adapter/runner/layered.py) and the benchmark's `qa_lowbit2`
method (bench/quality/methods.py) both call `choose_layer_chunks`, so the
benchmark measures the product's choice. docs/importance.md has the measurements.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from importance.selection import choose_chunks, edge_chunks
from importance.summaries import Budget, ChunkLayout, FixedBudget, chunk_mass, key_summary_of

Array = np.ndarray[Any, Any]
#: Tokens per chunk of the shipped choice (8: docs/importance.md, "Variants explored").
CHUNK_TOKENS = 8
#: Leading and trailing prefix tokens always read (two 8-token chunks each).
SINK_TOKENS = 16
RECENT_TOKENS = 16


def choose_layer_chunks(
    queries: Array,
    approx_keys: Array,
    budget: Budget | int,
    *,
    scale: float,
    summary_fraction: float = 0.0,
    chunk_tokens: int = CHUNK_TOKENS,
    sink_tokens: int = SINK_TOKENS,
    recent_tokens: int = RECENT_TOKENS,
) -> Array:
    """Sorted indices of the chunks of one layer to read (chunk c = tokens [c*chunk, (c+1)*chunk)).

    Args:
        queries: (query_heads, m, head_dim) the new tokens' queries, post-RoPE.
        approx_keys: (kv_heads, n, head_dim) the prefix's keys as the summary gives
            them (post-RoPE, prompt order), e.g. `LayeredLoad.key_summary(layer)`.
        budget: a `FixedBudget` / `AutoBudget` (fractions of the prefix's bytes, the
            summary's `summary_fraction` charged first), or an int: exactly that many
            chunks (the caller has charged the summary already).
        scale: the attention's softmax scale (head_dim ** -0.5).
        summary_fraction: the summary's bytes as a fraction of the prefix's.
        chunk_tokens: tokens per chunk.
        sink_tokens / recent_tokens: the first / last tokens always chosen (whole
            chunks holding them), while the budget allows.

    Raises:
        ValueError: bad shapes, a chunk count outside [0, chunks], or a budget below the summary.
    """
    keys = np.asarray(approx_keys, dtype=np.float32)
    if keys.ndim != 3 or np.ndim(queries) != 3 or np.shape(queries)[2] != keys.shape[2]:
        raise ValueError(
            f"queries {np.shape(queries)} and keys {keys.shape} must be (heads, tokens, head_dim)"
        )
    mass = query_chunk_mass(queries, keys, chunk_tokens, scale)
    return choose_by_mass(
        mass, keys.shape[1], budget, summary_fraction=summary_fraction, chunk_tokens=chunk_tokens,
        sink_tokens=sink_tokens, recent_tokens=recent_tokens,
    )  # fmt: skip


def query_chunk_mass(queries: Array, approx_keys: Array, chunk_tokens: int, scale: float) -> Array:
    """Each chunk's estimated share of the queries' attention, (chunks,), summing to 1.

    The reference arithmetic (numpy): per query head and query, logsumexp of q.k_hat over each
    chunk's tokens, softmax over chunks, then the mean over queries and heads. The engine
    computes the same in torch (engine_adapter/runner/chunk_mass.py; a test holds the two equal).
    """
    keys = np.asarray(approx_keys, dtype=np.float32)
    layout = ChunkLayout.natural(keys.shape[1], chunk_tokens)
    summary = key_summary_of(keys, layout, 0.0)
    return chunk_mass(summary.chunk_logits(queries, scale), keys.shape[0], per_kv_head=False)[0]


def choose_by_mass(
    mass: Array,
    num_tokens: int,
    budget: Budget | int,
    *,
    summary_fraction: float = 0.0,
    chunk_tokens: int = CHUNK_TOKENS,
    sink_tokens: int = SINK_TOKENS,
    recent_tokens: int = RECENT_TOKENS,
) -> Array:
    """Sorted chunk indices: the edge chunks, then chunks by descending `mass` (chunks,) within
    `budget` (see `choose_layer_chunks`). Raises ValueError on a bad count or budget."""
    layout = ChunkLayout.natural(num_tokens, chunk_tokens)
    mass = np.asarray(mass, dtype=np.float64).reshape(-1)
    if len(mass) != layout.num_chunks:
        raise ValueError(f"mass has {len(mass)} chunks, {num_tokens} tokens make {layout.num_chunks}")
    if isinstance(budget, int | np.integer):
        if not 0 <= budget <= layout.num_chunks:
            raise ValueError(f"chunk count must be in [0, {layout.num_chunks}], got {budget}")
        tokens = int(layout.sizes[np.argsort(layout.sizes)[::-1][:budget]].sum())  # room for `budget` chunks
        budget, summary_fraction = FixedBudget(tokens / num_tokens), 0.0
    forced = edge_chunks(layout, -(-sink_tokens // chunk_tokens), -(-recent_tokens // chunk_tokens))
    choice = choose_chunks(mass[None, :], layout, budget, summary_fraction, forced)
    return np.flatnonzero(choice.chosen[0])
